"""Reads by range from several processes that share one node cache: the server sends each
shard's bytes about once per node, however many processes read it by range before it is whole.

Three real processes (spawned, each with its own Loader and seed) read the same remote dataset
through one cache directory, from moto's S3 server behind the fault proxy, which counts the
body bytes it sends per request. The link is slow enough that the processes read rows by range
for a while before each shard is whole: counted per process, the range budget let the node be
sent 1.39-1.86x a shard's bytes here (2 workers each); counted per node, at most 1.25x.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import defaultdict

import numpy as np

from shardloader.ingest.writer import write_shards

SPAWN = mp.get_context("spawn")
PROCESSES = 3
WORKERS = 2  # each a process of its own, reading by range too


def _samples(n: int):
    rng = np.random.default_rng(7)
    for i in range(n):
        yield {"data": rng.integers(0, 256, 2048, dtype=np.uint8).tobytes(), "label": i}


def _epoch(url: str, options: dict, cache: str, seed: int, start, results) -> None:
    """One epoch of a Loader on the shared cache; reports the batches' sample indices and a
    digest of their bytes."""
    import hashlib

    from shardloader import Dataset, Loader

    ds = Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=options)
    loader = Loader(ds, batch_size=16, seed=seed, shuffle=True, partitions=4, window=2,
                    num_workers=WORKERS)
    start.wait(60)  # every process starts reading at once, on the cold cache
    indices, digest = [], hashlib.sha256()
    for batch in loader:
        indices += batch["__index__"].tolist()
        for data in batch["data"]:
            digest.update(data)
    loader.close()
    results.put((seed, indices, digest.hexdigest()))
    ds.close()


def _expected(path: str, seed: int) -> tuple[list[int], str]:
    import hashlib

    from shardloader import Dataset, Loader

    loader = Loader(Dataset(path), batch_size=16, seed=seed, shuffle=True, partitions=4, window=2)
    indices, digest = [], hashlib.sha256()
    for batch in loader:
        indices += batch["__index__"].tolist()
        for data in batch["data"]:
            digest.update(data)
    return indices, digest.hexdigest()


def test_processes_sharing_a_cache_are_sent_each_shard_about_once(tmp_path, s3_server, s3_url, fault_proxy):
    path = str(tmp_path / "ds")
    index = write_shards(_samples(1600), path, shard_samples=200)  # 8 shards of ~420 kB
    url = s3_url(path)
    proxy = fault_proxy(s3_server.endpoint, bandwidth=1.5e6, latency=0.01)  # downloads take a while
    options = s3_server.storage_options(proxy.url)
    cache = str(tmp_path / "cache")
    start, results = SPAWN.Barrier(PROCESSES), SPAWN.Queue()
    procs = [SPAWN.Process(target=_epoch, args=(url, options, cache, seed, start, results))
             for seed in range(PROCESSES)]
    for p in procs:
        p.start()
    reports = {}
    for _ in procs:
        seed, indices, digest = results.get(timeout=240)
        reports[seed] = (indices, digest)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for seed, got in reports.items():
        assert got == _expected(path, seed)  # every process read exactly its epoch
    sent: dict[str, int] = defaultdict(int)
    by_range = 0  # bytes of shards sent in answers to reads of some of their rows
    size = {os.path.basename(info.path): info.bytes for info in index.shards}
    for entry in proxy.settled():
        name = entry.path.split("?")[0].rsplit("/", 1)[-1]
        sent[name] += entry.sent
        by_range += entry.sent if name in size and entry.sent < size[name] else 0
    assert by_range > 0  # rows were read by range before their shards were whole
    ratios = {info.path: sent[os.path.basename(info.path)] / info.bytes for info in index.shards}
    assert all(sent[os.path.basename(info.path)] >= info.bytes for info in index.shards)  # each came whole
    print("bytes sent per shard / shard size:", {k: round(v, 3) for k, v in sorted(ratios.items())})
    assert max(ratios.values()) <= 1.25, ratios
