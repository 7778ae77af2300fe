"""A cold start from S3: the first batch's bytes (its range sidecars and its rows' spans) are
fetched in the background from the moment the Loader is made (`prefetch_policy.warm_first_batch`),
the sidecars kept off the node cache until that batch is out, and a failure of that background
fetch is fetched again where a read needs the sidecar (or raised there), never taken for "read
that shard whole".

Real parts only: moto's S3 server behind the fault proxy (its log is what proves which requests
were sent, and when), worker processes, the node cache's download locks (a held commit is
waited for by taking its lock, never with a sleep).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from shardloader import Dataset, Loader
from shardloader.cache import sidecars
from shardloader.cache.layout import sidecar_name
from shardloader.cache.locks import exclusive, held_elsewhere
from shardloader.cache.store import ShardCache
from shardloader.ingest.writer import write_shards
from tests.fixtures.servers import Fault, always, first
from tests.resume import take
from tests.sample_transforms import make_samples, noisy_crop

SETTINGS = {"batch_size": 16, "seed": 3, "shuffle": True, "transform": noisy_crop, "partitions": 4,
            "window": 2}


@pytest.fixture(scope="module")
def arrow_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cold-start") / "ds")
    write_shards(make_samples(400), path, shard_samples=50)  # 8 shards, each with a range sidecar
    return path


def _remote(url, cache, options) -> Dataset:
    return Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=options)


def _shards_of_step(loader: Loader, step: int, epoch: int = 0) -> list:
    """The index entries of the shards `step` of `epoch` reads (no data is read)."""
    index = loader.dataset.index
    shards, _ = index.locate_many(loader.step_samples(epoch, step))
    return [index.shards[s] for s in sorted(set(shards.tolist()))]


def _sidecar_gets(proxy) -> Counter:
    """Object name -> GETs of range sidecars the proxy answered, so far."""
    return Counter(entry.path.rsplit("/", 1)[-1] for entry in proxy.settled()
                   if entry.method == "GET" and entry.path.endswith(".ranges"))


def _sidecar_is(match):
    return lambda method, path, headers: method == "GET" and path.rsplit("/", 1)[-1] in match


def _fetched_ahead(loader: Loader) -> bool:
    """Wait (at most 60 s) until what `Loader()` started fetching in the background is in:
    the first batch's priming (which forked workers inherit), or its sidecars alone."""
    return loader._workers.wait_inherited(60) and loader.dataset.source.wait_warm(60)


def _on_node(cache: str, info) -> bool:
    """Whether the node cache holds `info`'s range sidecar, once no fill of it is in flight
    (its download lock is taken, so a held or running commit is waited for)."""
    store = ShardCache(cache, 1 << 30)
    name = sidecar_name(info.extra["ranges"]["checksum"], "ranges")
    try:
        with exclusive(store.layout.lock_of(name)):
            return os.path.exists(store.path_of(name))
    finally:
        store.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_loader_fetches_its_first_batch_before_it_is_iterated(
        arrow_dir, s3_server, s3_url, fault_proxy, tmp_path, monkeypatch, workers):
    monkeypatch.setattr(sidecars, "HOLD_SECONDS", 120.0)  # held until the first batch, not a timer
    reference = take(Loader(Dataset(arrow_dir), **SETTINGS), 3)
    proxy = fault_proxy(s3_server.endpoint)
    cache = str(tmp_path / "cache")
    ds = _remote(s3_url(arrow_dir), cache, s3_server.storage_options(proxy.url))
    loader = Loader(ds, num_workers=workers, **SETTINGS)
    assert _fetched_ahead(loader)
    firsts = _shards_of_step(loader, 0)
    # Before any next(): the first batch's range sidecars, each once, then spans of those shards
    # (ranges, never a whole shard), and nothing else.
    gets = [entry for entry in proxy.settled() if entry.method == "GET"
            and not entry.path.endswith("/index.json")]
    sidecar_gets = [e.path.rsplit("/", 1)[-1] for e in gets if e.path.endswith(".ranges")]
    span_gets = [e for e in gets if not e.path.endswith(".ranges")]
    assert sorted(sidecar_gets) == sorted(f"{i.path}.ranges" for i in firsts)
    size = {i.path: i.bytes for i in firsts}
    assert span_gets and all(e.path.rsplit("/", 1)[-1] in size for e in span_gets)
    assert all(e.range != f"bytes=0-{size[e.path.rsplit('/', 1)[-1]] - 1}" for e in span_gets)
    assert ds.source.counters()["range_requests"] == len(firsts) + len(span_gets)
    store = ShardCache(cache, 1 << 30)
    for info in firsts:  # fetched into this process; their commit to the node waits for the batch
        name = sidecar_name(info.extra["ranges"]["checksum"], "ranges")
        assert not os.path.exists(store.path_of(name)) and held_elsewhere(store.layout.lock_of(name))
    store.close()

    assert take(loader, 3) == reference  # the same batches, bit for bit
    loader.close()
    gets = _sidecar_gets(proxy)
    assert {f"{i.path}.ranges": gets[f"{i.path}.ranges"] for i in firsts} == {
        f"{i.path}.ranges": 1 for i in firsts}  # the priming waited for them: no second GET
    start = time.monotonic()
    assert all(_on_node(cache, info) for info in firsts)  # committed once the batch was out,
    assert time.monotonic() - start < 60  # not when the hold ran out


def test_a_restored_loader_fetches_the_sidecars_of_its_restored_first_batch(
        arrow_dir, s3_server, s3_url, fault_proxy, tmp_path):
    reference = take(Loader(Dataset(arrow_dir), **SETTINGS), 23)
    saved = Loader(Dataset(arrow_dir), **SETTINGS)
    take(saved, 20)  # step 20 reads none of the shards step 0 reads (asserted below)
    state = json.loads(json.dumps(saved.state_dict()))
    proxy = fault_proxy(s3_server.endpoint)
    ds = _remote(s3_url(arrow_dir), str(tmp_path / "cache"), s3_server.storage_options(proxy.url))
    loader = Loader(ds, num_workers=2, **SETTINGS)
    loader.load_state_dict(state)
    assert _fetched_ahead(loader)
    before = _sidecar_gets(proxy)  # epoch 0's first batch's (made, unless restored first), then step 20's
    wanted = {f"{i.path}.ranges" for i in _shards_of_step(loader, 20)}
    made = {f"{i.path}.ranges" for i in _shards_of_step(loader, 0)}
    assert wanted.isdisjoint(made)
    assert wanted <= set(before) <= wanted | made
    assert take(loader, 3) == reference[20:23]
    loader.close()
    assert all(_sidecar_gets(proxy)[name] == 1 for name in wanted)


def test_a_failed_background_fetch_is_fetched_again_by_the_read_that_needs_it(
        arrow_dir, s3_server, s3_url, fault_proxy, tmp_path, caplog):
    reference = take(Loader(Dataset(arrow_dir), **SETTINGS), 3)
    url = s3_url(arrow_dir)
    probe = Loader(Dataset(arrow_dir), **SETTINGS)
    firsts = _shards_of_step(probe, 0)
    names = {f"{i.path}.ranges" for i in firsts}
    # The background round (the first GET of each first-batch sidecar) is refused: 403, not
    # transient, so it fails at once.
    proxy = fault_proxy(s3_server.endpoint, plan=first(len(names), Fault("status", status=403),
                                                       match=_sidecar_is(names)))
    ds = _remote(url, str(tmp_path / "cache"), s3_server.storage_options(proxy.url))
    loader = Loader(ds, num_workers=2, **SETTINGS)
    assert _fetched_ahead(loader)
    proxy.settled()
    assert len(proxy.faults()) == len(names)
    with caplog.at_level(logging.WARNING, logger="shardloader.source.ranged"):
        got = take(loader, 3)
    loader.close()
    assert got == reference
    # Each was fetched again, by the priming, and read by range: not "read that shard whole".
    log = proxy.settled()
    assert {name: n for name, n in _sidecar_gets(proxy).items() if name in names} == dict.fromkeys(names, 2)
    for info in firsts:
        reads = [e for e in log if e.method == "GET" and e.path.endswith(f"/{info.path}")]
        whole = [e.number for e in reads if e.range == f"bytes=0-{info.bytes - 1}"]
        spans = [e.number for e in reads if e.range != f"bytes=0-{info.bytes - 1}"]
        assert spans and (not whole or min(spans) < min(whole)), info.path
    for info in firsts:  # and said so, naming the shard and why
        assert f"{url}/{info.path}: the background fetch of its range sidecar failed" in caplog.text
    assert "403" in caplog.text


def test_a_sidecar_that_keeps_failing_is_a_warning_and_its_shard_is_read_whole(
        arrow_dir, s3_server, s3_url, fault_proxy, tmp_path):
    reference = take(Loader(Dataset(arrow_dir), **SETTINGS), 2)
    url = s3_url(arrow_dir)
    names = {f"{i.path}.ranges" for i in _shards_of_step(Loader(Dataset(arrow_dir), **SETTINGS), 0)}
    proxy = fault_proxy(s3_server.endpoint, plan=always(Fault("status", status=403), match=_sidecar_is(names)))
    ds = _remote(url, str(tmp_path / "cache"), s3_server.storage_options(proxy.url))
    loader = Loader(ds, **SETTINGS)  # no workers: the warning is raised in this process
    assert _fetched_ahead(loader)
    with pytest.warns(UserWarning, match=rf"range sidecars not readable \({url}/.*\.ranges: .*403.*\); "
                                         r"reading those shards whole"):
        got = take(loader, 2)
    loader.close()
    assert got == reference
    assert all(n == 2 for name, n in _sidecar_gets(proxy).items() if name in names)  # background, then read


_EXIT_SCRIPT = """
import json, sys, time
from shardloader import Dataset, Loader
url, cache, options = json.loads(sys.argv[1])
loader = Loader(Dataset(url, cache_dir=cache, cache_limit="1GB", storage_options=options), batch_size=16,
                seed=3, shuffle=True, num_workers=2)
print("made", flush=True)
sys.stdin.readline()  # the test holds the sidecars' GETs until it has seen "made"
start = time.monotonic()
loader.close()
print(f"closed {time.monotonic() - start:.3f}", flush=True)
"""


def test_a_background_fetch_on_a_silent_server_delays_neither_close_nor_exit(
        arrow_dir, s3_server, s3_url, fault_proxy, tmp_path):
    release = threading.Event()

    def hold(number, method, path, headers):  # the sidecars' GETs get no answer while it runs
        if method == "GET" and path.endswith(".ranges"):
            release.wait(120)  # set in the finally below; the bound is a safety net
        return None

    proxy = fault_proxy(s3_server.endpoint, plan=hold)
    args = json.dumps([s3_url(arrow_dir), str(tmp_path / "cache"), s3_server.storage_options(proxy.url)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "made"
        assert proxy.wait_for_requests(2, timeout=60)  # index.json, then a sidecar GET held
        start = time.monotonic()
        out, _ = child.communicate("\n", timeout=60)
        took = time.monotonic() - start
        assert child.returncode == 0
        closed = float(out.split()[-1])
        assert closed < 2.0 and took < 10.0, (closed, took)  # bounded, while the GET still hangs
        assert not release.is_set()
    finally:
        release.set()
        if child.poll() is None:
            child.kill()
            child.wait(10)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_first_batch_fetched_before_iter_needs_no_request_after_it(
        arrow_dir, s3_server, s3_url, fault_proxy, tmp_path, workers):
    """What `Loader()` fetched in the background is what the first batch reads, in this process
    or in the worker forked afterwards: once it is in, the server refuses everything, and the
    first batch still comes out, bit for bit."""
    reference = take(Loader(Dataset(arrow_dir), **SETTINGS), 1)
    refuse = threading.Event()
    proxy = fault_proxy(s3_server.endpoint,
                        plan=lambda number, method, path, headers:
                        Fault("status", status=403) if refuse.is_set() else None)
    ds = _remote(s3_url(arrow_dir), str(tmp_path / "cache"), s3_server.storage_options(proxy.url))
    loader = Loader(ds, num_workers=workers, **SETTINGS)
    assert _fetched_ahead(loader)
    refuse.set()
    assert take(loader, 1) == reference  # a request for it now would be refused, and raise
    loader.close()
