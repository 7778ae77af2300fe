"""Range sidecars are entries of the node cache (shardloader.cache.sidecars): whichever processes
of a node read a shard by range, the server is asked for each of its sidecars once, and the
cache counts the sidecars' bytes in its limit, evicts and prunes them like shards.

Everything goes through real parts: the loopback S3 server behind the fault proxy (whose log is
what proves "once"), spawned processes sharing one cache directory, a Loader with two worker
processes, the kernel's flock table (/proc/locks) to see who waits on whom.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections import Counter

import pytest

from shardloader import Dataset, Loader
from shardloader.cache.layout import sidecar_name
from shardloader.cache.maintenance import prune, usage, verify_all
from shardloader.cache.store import ShardCache
from shardloader.cli.main import main
from shardloader.format.registry import shard_format
from shardloader.ingest.writer import write_shards
from tests.resume import take
from tests.sample_transforms import make_samples, noisy_crop

SPAWN = mp.get_context("spawn")
READERS = 3
#: How long the proxy holds the first sidecar GET at most while it waits for the other readers
#: to queue up (a safety net: the test fails when it runs out, it never hangs).
HOLD_LIMIT = 90.0


@pytest.fixture(scope="module", params=["arrow", "tar"])
def dataset_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"sidecars-{request.param}") / "ds")
    write_shards(make_samples(200), path, shard_samples=50, format=request.param)
    return path


def _sidecars_of(info) -> dict[str, tuple[str, int, str]]:
    """kind -> (object name, bytes, cache name) of the sidecars a read by range of `info` needs."""
    keys = ["ranges"]
    companion = shard_format(info.format).companion
    if companion is not None:
        keys.append(companion.key)
    out = {}
    for key in keys:
        entry = info.extra[key]
        out[key] = (entry["path"], entry["bytes"], sidecar_name(entry["checksum"], key))
    return out


def _lock_waiters(inodes: set[int]) -> int:
    """Processes blocked in flock() on files with these inode numbers, from the kernel's table."""
    waiting = 0
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[1] == "->":
                device_inode = fields[6] if fields[2] == "FLOCK" else ""
                if device_inode and int(device_inode.rsplit(":", 1)[1]) in inodes:
                    waiting += 1
    return waiting


def _hold_sidecars_until_all_queue(names: set[str], lock_files: list[str], state: dict):
    """A proxy plan: the first GET of one of `names` waits until every reader has asked for it
    too (one GET each: a per-process download) or the other readers wait on the sidecars'
    download locks (`lock_files`) on the node, whichever comes first; HOLD_LIMIT bounds it."""
    arrived = Counter()
    cond = threading.Condition()

    def queued() -> bool:
        if max(arrived.values(), default=0) >= READERS:
            return True
        inodes = set()
        for path in lock_files:
            try:
                inodes.add(os.stat(path).st_ino)
            except FileNotFoundError:
                pass
        return bool(inodes) and _lock_waiters(inodes) >= READERS - 1

    def plan(number, method, path, headers):
        name = path.split("?", 1)[0].rsplit("/", 1)[-1]
        if method != "GET" or name not in names:
            return None
        with cond:
            arrived[name] += 1
            cond.notify_all()
            if state.get("released"):
                return None
            deadline = time.monotonic() + HOLD_LIMIT
            while not queued():
                left = deadline - time.monotonic()
                if left <= 0:
                    state["timed_out"] = True
                    break
                cond.wait(min(left, 0.05))  # re-reads /proc/locks: waiters do not notify
            state["released"] = True
            cond.notify_all()
        return None

    return plan


def _read_by_range(url, cache, options, samples, results):
    """One process of the node: read `samples` by range (as under a Loader, whose prefetcher
    downloads whole shards behind), report the rows and this process's counters."""
    ds = Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=options)
    ds.source.expect_prefetch()
    rows = ds.get_many(samples)
    results.put((os.getpid(), rows, ds.source.counters()))
    ds.close()


def _sidecar_gets(proxy, prefix: str) -> Counter:
    return Counter(entry.path[len(prefix):] for entry in proxy.settled()
                   if entry.method == "GET" and entry.path.endswith((".ranges", ".idx")))


def test_three_processes_fetch_each_sidecar_once_and_the_cache_accounts_for_it(
        dataset_dir, s3_server, s3_url, fault_proxy, tmp_path):
    url = s3_url(dataset_dir)
    prefix = "/" + url[len("s3://"):] + "/"
    local = Dataset(dataset_dir)
    info = local.index.shards[0]
    sidecars = _sidecars_of(info)
    cache = str(tmp_path / "cache")
    state: dict = {}
    lock_files = [os.path.join(cache, "locks", name + ".lock") for _, _, name in sidecars.values()]
    proxy = fault_proxy(s3_server.endpoint, _hold_sidecars_until_all_queue(
        {obj for obj, _, _ in sidecars.values()}, lock_files, state))
    options = s3_server.storage_options(proxy.url)
    samples = [3, 17, 41]  # rows of shard 0
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=_read_by_range, args=(url, cache, options, samples, results))
             for _ in range(READERS)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=120) for _ in procs]
    finally:
        state["released"] = True
        for p in procs:
            p.join(30)
    assert [p.exitcode for p in procs] == [0] * READERS
    assert not state.get("timed_out"), "the other readers neither fetched the sidecar nor waited for it"
    want = local.get_many(samples)
    assert all(rows == want for _, rows, _ in reports)  # every process read the rows by range
    assert all(c["range_reads"] >= 1 and c["downloads"] == 0 for _, _, c in reports)
    # The server was asked for each sidecar once on the node, by one of the three processes.
    assert _sidecar_gets(proxy, prefix) == Counter({obj: 1 for obj, _, _ in sidecars.values()})
    sidecar_bytes = sum(size for _, size, _ in sidecars.values())
    assert sum(c["range_bytes"] for _, _, c in reports) >= sidecar_bytes

    # The node cache holds them as entries: in the ledger, in the usage, verified, prunable.
    store = ShardCache(cache, 1 << 30)
    entries = store.ledger.entries()
    assert {name: entries[name].bytes for _, _, name in sidecars.values()} == {
        name: size for _, size, name in sidecars.values()}
    assert usage(store)["sidecar_bytes"] == sidecar_bytes
    assert store.ledger.high_water() >= sidecar_bytes  # reserved within the limit like a shard
    assert sorted(status for _, status, _ in verify_all(store)) == ["ok"] * len(sidecars)

    if info.format == "tar":
        # The whole shard's offsets companion comes from the node's entry: no second GET.
        remote = Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=options)
        path = remote.source.local_path(info)
        with open(path + shard_format("tar").companion.suffix, "rb") as f, \
                open(os.path.join(dataset_dir, sidecars["offsets"][0]), "rb") as g:
            assert f.read() == g.read()
        remote.source.release(info)
        remote.close()
        gets = _sidecar_gets(proxy, prefix)
        assert gets == Counter({obj: 1 for obj, _, _ in sidecars.values()}), gets

    held = store.ledger.entries()  # the sidecars, and a tar's whole shard read just now
    pruned = prune(store, 0)
    assert pruned["remaining"] == 0 and pruned["evicted"] == len(held)
    assert pruned["evicted_sidecars"] == len(sidecars)
    assert pruned["bytes_freed"] == sum(e.bytes for e in held.values())
    assert store.ledger.entries() == {} and usage(store)["sidecar_bytes"] == 0
    for _, _, name in sidecars.values():
        assert not os.path.exists(store.path_of(name))
    store.close()


def test_a_loader_with_two_workers_fetches_each_sidecar_once_per_node(tmp_path, s3_server, s3_url,
                                                                      fault_proxy):
    data = str(tmp_path / "ds")
    write_shards(make_samples(240), data, shard_samples=20)  # 12 shards, each with a sidecar
    url = s3_url(data)
    prefix = "/" + url[len("s3://"):] + "/"
    proxy = fault_proxy(s3_server.endpoint)
    cache = str(tmp_path / "cache")

    def make(source):
        return Loader(source, batch_size=16, seed=3, shuffle=True, num_workers=2, transform=noisy_crop,
                      partitions=4, window=2, persistent_workers=False)

    remote = Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=s3_server.storage_options(proxy.url))
    loader = make(remote)
    steps = 2 * len(loader)  # two epochs: a fresh pair of workers each
    assert take(loader, steps) == take(make(Dataset(data)), steps)
    loader.close()
    gets = _sidecar_gets(proxy, prefix)
    # Each sidecar the run read by range was fetched once, by one of the three processes
    # (the training process's priming and warm-up thread, or a worker), whatever the timing.
    assert gets and set(gets.values()) == {1}, gets
    store = ShardCache(cache, 1 << 30)
    sizes = {name: os.path.getsize(os.path.join(data, name)) for name in gets}
    assert usage(store)["sidecar_bytes"] == sum(sizes.values())
    store.close()


def test_sidecars_count_in_the_limit_and_make_room_for_shards(tmp_path, s3_server, s3_url, capsys):
    data = str(tmp_path / "ds")
    write_shards(make_samples(200), data, shard_samples=50)
    url = s3_url(data)
    index = Dataset(data).index
    cache = str(tmp_path / "cache")
    reader = Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=s3_server.storage_options())
    reader.source.expect_prefetch()
    assert reader.get_many([0, 50, 100, 150]) == Dataset(data).get_many([0, 50, 100, 150])
    reader.close()
    names = {sidecar_name(info.extra["ranges"]["checksum"], "ranges"): info.extra["ranges"]["bytes"]
             for info in index.shards}
    total = sum(names.values())
    assert main(["cache", "info", cache]) == 0
    assert f"{cache}: 0 shards and 4 range sidecars, " in capsys.readouterr().out
    # A cache whose limit the sidecars fill but for one shard: downloading a shard evicts
    # sidecars (least recently used first) and the limit holds.
    biggest = max(info.bytes for info in index.shards)
    store = ShardCache(cache, biggest + total // 2)
    assert {n: e.bytes for n, e in store.ledger.entries().items()} == names
    whole = Dataset(url, cache_dir=cache, cache_limit=biggest + total // 2,
                    storage_options=s3_server.storage_options())
    info = index.shards[0]
    whole.source.local_path(info)
    whole.source.release(info)
    counters = whole.source.counters()
    assert counters["evictions"] >= 1 and counters["downloads"] == 1
    left = store.ledger.entries()
    shard = os.path.basename(whole.source.store.path_for(info))
    assert shard in left and sum(e.bytes for e in left.values()) <= biggest + total // 2
    assert set(left) - {shard} < set(names)  # sidecars made the room
    whole.close()
    store.close()
    assert main(["cache", "prune", cache, "--to", "0"]) == 0
    assert f"evicted 1 shards and {len(left) - 1} range sidecars" in capsys.readouterr().out


def test_a_sidecar_damaged_in_the_cache_is_discarded_and_fetched_again(tmp_path, s3_server, s3_url,
                                                                       fault_proxy, caplog):
    data = str(tmp_path / "ds")
    write_shards(make_samples(100), data, shard_samples=50)
    url = s3_url(data)
    prefix = "/" + url[len("s3://"):] + "/"
    proxy = fault_proxy(s3_server.endpoint)
    options = s3_server.storage_options(proxy.url)
    cache = str(tmp_path / "cache")
    want = Dataset(data).get_many([1, 2])

    def read():  # a fresh Dataset: nothing decoded in memory, what the node holds or the server
        ds = Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=options)
        ds.source.expect_prefetch()
        rows = ds.get_many([1, 2])
        ds.close()
        return rows

    assert read() == want
    info = Dataset(data).index.shards[0]
    store = ShardCache(cache, 1 << 30)
    path = store.path_of(sidecar_name(info.extra["ranges"]["checksum"], "ranges"))
    with open(path, "r+b") as f:  # damaged on the node's disk after it was verified
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert read() == want  # it does not verify against the index: discarded, fetched again
    assert path in caplog.text
    assert "failed verification: checksum " in caplog.text  # same size: the checksum says why
    assert f"the index says {info.extra['ranges']['checksum']}" in caplog.text
    assert _sidecar_gets(proxy, prefix) == Counter({info.extra["ranges"]["path"]: 2})
    assert [status for p, status, _ in verify_all(store) if p == path] == ["ok"]
    assert read() == want  # and the good copy is read from the node from then on
    assert _sidecar_gets(proxy, prefix) == Counter({info.extra["ranges"]["path"]: 2})
    store.close()
