"""Two nodes on this machine: two torchrun agents (`--nnodes 2`, rendezvous on 127.0.0.1), each
with its own cache directory, reading one dataset from loopback S3 (moto). Each node downloads
every shard it reads exactly once in the epoch, and the global sequence (samples and augmented
bytes) equals the one-node run's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from shardloader import Dataset, Loader
from shardloader.ingest.writer import write_shards
from tests.sample_transforms import make_samples, noisy_crop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(node_rank: int, port: int, url: str, endpoint: str, cache: str, out: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "tests.dist.cache_node", "--url", url, "--endpoint", endpoint, "--cache", cache,
           "--global-batch", str(GLOBAL_BATCH), "--out", out, "--workers", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "src")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_two_nodes_download_each_shard_once_and_read_the_one_node_sequence(tmp_path, s3_server):
    data = str(tmp_path / "ds")
    index = write_shards(make_samples(264), data, shard_samples=11)  # 24 shards, 22 global batches
    url = s3_server.upload_dir(data, s3_server.create_bucket(), "ds")
    reference_loader = Loader(Dataset(data), batch_size=GLOBAL_BATCH, shuffle=True, seed=5, transform=noisy_crop,
                              partitions=4, window=2, rank=0, world_size=1)
    reference = [(i, c.numpy().tobytes().hex()) for b in reference_loader
                 for i, c in zip(b["__index__"].tolist(), b["crop"])]
    out = str(tmp_path / "out")
    os.makedirs(out)
    port = _free_port()
    nodes = [_node(r, port, url, s3_server.endpoint, str(tmp_path / f"cache-node{r}"), out) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    ranks = []
    for r in (0, 1):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    # The global sequence: position p went to rank p mod 2.
    sequence = []
    for step in range(len(ranks[0]["batches"])):
        merged = [None] * GLOBAL_BATCH
        for r in (0, 1):
            batch = ranks[r]["batches"][step]
            for i, pair in enumerate(zip(batch["indices"], batch["crops"])):
                merged[r + 2 * i] = pair
        sequence.extend(merged)
    assert [i for i, _ in sequence] == [i for i, _ in reference]
    assert sequence == reference
    # Each node downloaded exactly the shards its rank read, each once.
    for r in (0, 1):
        read = {index.locate(i)[0] for b in ranks[r]["batches"] for i in b["indices"]}
        node = ranks[r]["node"]
        assert node["downloads"] == len(read) and node["redownloads"] == 0, (r, node, len(read))
        assert node["bytes_downloaded"] == sum(index.shards[s].bytes for s in read), (r, node)
    # With 4 partitions over 2 ranks each rank reads mostly its own partitions' shards.
    assert ranks[0]["node"]["downloads"] < index.num_shards
