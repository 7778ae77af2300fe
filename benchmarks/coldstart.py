"""The cold first batch from S3, phase by phase: where the time from `import shardloader` to
the first batch goes. (`--sources`: the goal table per credential source beside the peers,
`benchmarks.coldstart_sources`.)

Layout (issue 24's, near enough): `benchmarks._images` JPEGs of 128-256 px (~14.6 KiB on
average; the issue's are ~11 KiB), 1,000 per shard (14.8 MB per shard; `--images 20000` is its
20 shards), served by moto on loopback (`benchmarks._s3`, its own
process). Each try is a fresh interpreter with an empty cache directory, reading the first batch
(64 samples, shuffled, `Compose([DecodeCropFlip(112), ToTensor()])`, the settings of
`benchmarks.speed`) with `--workers` 0 and 2, alternated.

What is timed, in the child, on one clock (`time.perf_counter`, CLOCK_MONOTONIC: the same in
forked workers):

* imports: `import torch`, then `import shardloader` (+ `Dataset`, `Loader`, the transforms),
  then the internals this benchmark wraps (which `Dataset()`/`iter()` would import otherwise);
* `Dataset()`: its total, and the index GET inside it;
* `Loader()`;
* the first batch's range sidecars fetched in the background from `Loader()` ("sidecars
  ahead": when that round started, how long it took, when it was ready relative to priming);
* `next(iter(loader))`, split into: the epoch's set-up before priming (capacity check), priming
  (the range sidecars: its own round, or its wait for the round started at `Loader()`; then
  the rows' spans round: requests, bytes, and the concurrency reached; the sidecars' commits,
  in whichever thread ran them), worker start (the fork, `PoolKeeper.get`), a worker's own set-up until it starts
  its first task, the task (reading rows, then decode + transform + collate, from the loader's
  `BatchTimings`), and the hand-off (worker done -> `next()` returns in the training process);
* the training process's garbage collections (`gc.callbacks`), and the next 4 batches, to see
  whether a change removes time or only moves it past the first batch.

The wrappers only record (start, end) of the library's own functions into a file of events
(one JSON line each, appended by whichever process runs them); they change no behaviour. Every
S3 GET of the library's S3 client is one event (so requests are counted, with their bytes,
whoever sends them). Figures are medians of `--repeats` tries; on the shared 2-core machine
they are noisy, the medians less so.

    .venv/bin/python -m benchmarks.coldstart [--images 20000] [--repeats 3] [--workers 0,2]

Its first version also patched proposed changes into the children for A/B runs: the
producer's warm-up during priming without worker processes (decode 37.5 -> 17.2 ms, now the
library's behaviour) and three ways of taking the garbage collector's full collection off the
first `next()`; the library's own answer (`shardloader.runtime.startup`: the pause's objects
promoted uncollected) left nothing for those to remove ("GC in training process" is 0.0 ms
here), and copies of the library's code they needed were dropped with them.

`--user-seconds S` sleeps S seconds between `Loader()` and `iter()`, as a training script
builds its model there: what the range sidecars fetched from `Loader()` on save then shows in
"from iter() to batch".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 64
SEED = 17
SIZE = 112
EVENTS_ENV = "SHARDLOADER_BENCH_EVENTS"

# -- the child: one cold start, instrumented -----------------------------------------------------


def _event(what: str, t0: float, t1: float, **extra: Any) -> None:
    """Append one event to the events file (any process: O_APPEND, one write per line)."""
    line = json.dumps({"what": what, "pid": os.getpid(), "t0": t0, "t1": t1, **extra}) + "\n"
    fd = os.open(os.environ[EVENTS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _timed(owner: Any, name: str, what: str, describe: Any = None) -> None:
    """Replace `owner.name` by a wrapper that records its (start, end) as event `what`."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = inner(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
        _event(what, t0, t1, **(describe(args, kwargs, out) if describe else {}))
        return out

    wrapper.__wrapped__ = inner  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _instrument() -> None:
    import threading

    from shardloader.cache import sidecars
    from shardloader.io import s3client
    from shardloader.loader import batches, pool_keeper, prefetch_policy, recording
    from shardloader.loader.workers import pool
    from shardloader.source import ranged

    _timed(s3client.S3Reader, "_get", "get", lambda a, k, out: {
        "path": a[1], "range": a[2], "bytes": out if isinstance(out, int) else len(out),
        "thread": threading.current_thread().name})
    _timed(ranged.RangeReads, "_load", "sidecars", lambda a, k, out: {"shards": len(a[1])})
    _timed(ranged.RangeReads, "_fetch_spans", "spans", lambda a, k, out: {
        "shards": len(a[1]), "spans": sum(len(x) for x in out)})
    _timed(ranged.RangeReads, "_fetch_sidecars", "sidecar_gets")
    _timed(ranged.RangeReads, "_states", "states")
    _timed(sidecars, "_commit", "sidecar_commit")
    _timed(ranged.RangeReads, "prime", "prime", lambda a, k, out: {"kept": out})
    _timed(ranged.RangeReads, "read", "range_read")
    _timed(ranged.RangeReads, "warm", "warm")
    _timed(batches.BatchProducer, "warm_up", "warm_up")
    _timed(prefetch_policy.EpochPrefetch, "__init__", "epoch_setup")
    _timed(prefetch_policy.EpochPrefetch, "before_workers", "before_workers")
    _timed(pool_keeper.PoolKeeper, "get", "pool_start")
    _timed(prefetch_policy.EpochPrefetch, "start_deferred", "start_prefetch")
    _timed(prefetch_policy, "shards_ahead", "shards_ahead")
    _timed(recording.BatchRecorder, "record", "record")
    _timed(pool.ProcessPool, "get", "pool_get")
    _timed(batches.BatchProducer, "__call__", "task", lambda a, k, out: {
        "step": a[1].step, "read_s": out[1].figures["read_seconds"],
        "transform_s": out[1].figures["transform_seconds"],
        "wait_s": out[1].figures["shard_wait_seconds"], "extra": dict(out[1].extra)})
    import gc

    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            _event("gc", started.pop("t"), time.perf_counter(), generation=info["generation"],
                   collected=info["collected"])

    gc.callbacks.append(on_gc)
    main = pool._worker_main

    def worker_main(*args: Any, **kwargs: Any) -> Any:
        _event("worker_enter", time.perf_counter(), time.perf_counter())
        return main(*args, **kwargs)

    pool._worker_main = worker_main


def child(spec: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    import torch  # noqa: F401 - a training script has it imported
    t_torch = time.perf_counter()
    from shardloader import Dataset, Loader
    from shardloader.transforms import Compose, DecodeCropFlip, ToTensor
    t_ours = time.perf_counter()
    _instrument()
    t_internals = time.perf_counter()
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": spec["endpoint"], "region_name": "us-east-1"}}
    ds = Dataset(spec["url"], cache_dir=spec["cache_dir"], storage_options=options)
    t_ds = time.perf_counter()
    loader = Loader(ds, batch_size=BATCH, num_workers=spec["workers"], seed=SEED, tail="partial",
                    shuffle=True, persistent_workers=spec["workers"] > 0,
                    transform=Compose([DecodeCropFlip(SIZE), ToTensor()]))
    t_loader = time.perf_counter()
    time.sleep(spec.get("user_seconds", 0.0))  # a script builds its model here
    t_iter = time.perf_counter()
    it = iter(loader)
    batch = next(it)
    t_batch = time.perf_counter()
    assert int(batch["__index__"].numel()) == BATCH
    for _ in range(4):  # where the time moved to, if it did: the next batches
        next(it)
    t_fifth = time.perf_counter()
    del it
    counters = ds.source.counters()
    loader.close()
    ds.close()
    return {"t_start": t_start, "t_torch": t_torch, "t_ours": t_ours, "t_internals": t_internals,
            "t_ds": t_ds, "t_loader": t_loader, "t_iter": t_iter, "t_batch": t_batch, "t_fifth": t_fifth, "pid": os.getpid(),
            "parent_range_requests": counters.get("range_requests", 0),
            "parent_range_bytes": counters.get("range_bytes", 0)}


def run_try(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One cold start in a fresh interpreter and empty cache; its phases."""
    cache = tempfile.mkdtemp(prefix="coldstart-", dir=os.path.join(ROOT, "benchmarks", "out"))
    events = os.path.join(cache, "events.jsonl")
    spec = {**spec, "cache_dir": os.path.join(cache, "cache")}
    full_env = {**os.environ, **env, EVENTS_ENV: events, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH", ""), ROOT) if p)}
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.coldstart", "--child", json.dumps(spec)],
                              cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
        with open(events) as f:
            evs = [json.loads(x) for x in f if x.strip()]
        return phases(json.loads(lines[-1]), evs)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# -- from events to phases ------------------------------------------------------------------------


def _concurrency(gets: list[dict[str, Any]]) -> int:
    """The most GETs in flight at once."""
    marks = sorted([(g["t0"], 1) for g in gets] + [(g["t1"], -1) for g in gets])
    most = now = 0
    for _, d in marks:
        now += d
        most = max(most, now)
    return most


def _within(gets: list[dict[str, Any]], ev: dict[str, Any] | None) -> list[dict[str, Any]]:
    if ev is None:
        return []
    return [g for g in gets if g["pid"] == ev["pid"] and g["t0"] >= ev["t0"] and g["t1"] <= ev["t1"]]


def phases(c: dict[str, Any], evs: list[dict[str, Any]]) -> dict[str, Any]:
    parent = c["pid"]
    end = c["t_batch"]
    gets = [e for e in evs if e["what"] == "get" and e["t0"] < end]
    evs = [e for e in evs if e["t0"] < c["t_fifth"]]

    def first(what: str, pid: int | None = parent, **match: Any) -> dict[str, Any] | None:
        for e in sorted(evs, key=lambda e: e["t0"]):
            if e["what"] == what and (pid is None or e["pid"] == pid) and \
                    all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    out: dict[str, Any] = {
        "import torch": c["t_torch"] - c["t_start"],
        "import shardloader": c["t_ours"] - c["t_torch"],
        "import internals": c["t_internals"] - c["t_ours"],
        "Dataset()": c["t_ds"] - c["t_internals"],
        "Loader()": c["t_loader"] - c["t_ds"],
    }
    index_gets = [g for g in gets if c["t_internals"] <= g["t0"] and g["t1"] <= c["t_ds"]]
    out["  index GET"] = sum(g["t1"] - g["t0"] for g in index_gets)
    setup, before, pool_start = first("epoch_setup"), first("before_workers"), first("pool_start")
    prime = first("prime")
    t_iter = c.get("t_iter", c["t_loader"])
    out["iter: set-up to priming"] = (before or setup or {"t0": t_iter})["t0"] - t_iter if setup else 0.0
    warm = first("warm")
    if warm is not None and (prime is None or warm["t0"] < prime["t0"]):  # from Loader()
        own = [e for e in evs if e["what"] == "sidecars" and e["pid"] == parent
               and e["t0"] >= warm["t0"] and e["t1"] <= warm["t1"]]
        out["sidecars ahead: start rel. to Loader()"] = warm["t0"] - c["t_ds"]
        out["sidecars ahead: round (fetch+decode)"] = sum(e["t1"] - e["t0"] for e in own)
        if own and prime is not None:
            out["sidecars ahead: ready rel. to prime"] = own[-1]["t1"] - prime["t0"]
    if prime is not None:
        tables = [e for e in evs if e["what"] == "states" and e["pid"] == parent
                  and e["t0"] >= prime["t0"] and e["t1"] <= prime["t1"]]
        out["  prime: sidecar tables (round or wait)"] = tables[0]["t1"] - tables[0]["t0"] if tables else 0.0
        side = [e for e in evs if e["what"] == "sidecars" and e["pid"] == parent
                and e["t0"] >= prime["t0"] and e["t1"] <= prime["t1"]]
        spans = [e for e in evs if e["what"] == "spans" and e["pid"] == parent
                 and e["t0"] >= prime["t0"] and e["t1"] <= prime["t1"]]
        # the first batch's sidecars, whichever thread fetched them (prime, or the one from Loader())
        side_gets = [g for g in gets if g["pid"] == parent and g["path"].endswith(".ranges")
                     and g["t1"] <= prime["t1"]]
        span_gets = [g for s in spans for g in _within(gets, s)]
        out["  prime: sidecars round"] = sum(s["t1"] - s["t0"] for s in side)
        # the first batch's sidecars: fetched by prime, or by the thread started at Loader()
        sg = [e for e in evs if e["what"] == "sidecar_gets" and e["pid"] == parent and e["t1"] <= prime["t1"]][:1]
        sc = [e for e in evs if e["what"] == "sidecar_commit" and e["pid"] == parent and e["t0"] < prime["t1"]]
        out["    sidecar GETs (wall)"] = sum(e["t1"] - e["t0"] for e in sg)
        out["    sidecar commits (sum, any thread)"] = sum(e["t1"] - e["t0"] for e in sc)
        out["    sidecar commits inside the spans round"] = sum(
            max(0.0, min(e["t1"], s["t1"]) - max(e["t0"], s["t0"])) for e in sc for s in spans)
        out["  prime: spans round"] = sum(s["t1"] - s["t0"] for s in spans)
        out["  prime: other"] = (prime["t1"] - prime["t0"]) - out["  prime: sidecar tables (round or wait)"] \
            - out["  prime: spans round"]
        out["#sidecar GETs"] = len(side_gets)
        out["#span GETs"] = len(span_gets)
        out["span MB"] = sum(g["bytes"] for g in span_gets) / 1e6
        out["sidecar MB"] = sum(g["bytes"] for g in side_gets) / 1e6
        out["span GETs in flight (max)"] = _concurrency(span_gets)
        out["span GET latency (median)"] = statistics.median(
            [g["t1"] - g["t0"] for g in span_gets]) if span_gets else 0.0
        out["shards primed"] = spans[0]["shards"] if spans else 0
    if before is not None:
        out["iter: priming (before fork)"] = before["t1"] - before["t0"]
        warm = first("warm_up")
        out["  warm_up (overlaps priming)"] = (warm["t1"] - warm["t0"]) if warm else 0.0
    if pool_start is not None:
        out["iter: worker start (fork)"] = pool_start["t1"] - pool_start["t0"]
    task = first("task", None, step=0)
    if task is not None:
        if task["pid"] != parent:
            enter = [e for e in evs if e["what"] == "worker_enter" and e["pid"] == task["pid"]]
            out["worker: set-up to first task"] = task["t0"] - (pool_start["t1"] if pool_start else task["t0"])
            out["  worker entered, rel. to fork end"] = enter[0]["t0"] - pool_start["t1"] if enter and pool_start else 0.0
        else:
            out["iter: after pool to task"] = task["t0"] - (pool_start["t1"] if pool_start else task["t0"])
        out["task: read rows"] = task["read_s"] + task["wait_s"]
        out["task: decode+transform+collate"] = task["transform_s"]
        out["task: other"] = (task["t1"] - task["t0"]) - out["task: read rows"] - out["task: decode+transform+collate"]
        out["#GETs in the task"] = int(task["extra"].get("range_requests", 0)) if task["pid"] != parent else \
            len(_within(gets, task))
        out["hand-off to next()"] = end - task["t1"]
        got = first("pool_get")
        if got is not None and task["pid"] != parent:
            out["  worker done -> pool.get returns"] = got["t1"] - task["t1"]
        for what, name in (("start_prefetch", "  start deferred prefetch"),
                           ("shards_ahead", "    of which shards_ahead"), ("record", "  record batch")):
            e = first(what)
            if e is not None and e["t0"] < end:
                out[name] = e["t1"] - e["t0"]
                if what == "start_prefetch":
                    out["  prefetch started -> next() returns"] = end - e["t1"]
    collections = [e for e in evs if e["what"] == "gc" and e["pid"] == parent and e["t0"] < end]
    out["GC in training process (sum)"] = sum(e["t1"] - e["t0"] for e in collections
                                              if e["t0"] >= c["t_internals"])
    if task is not None:
        late = [e for e in collections if e["t0"] >= task["t1"]]
        out["  GC during hand-off"] = sum(e["t1"] - e["t0"] for e in late)
        out["#full GCs in hand-off"] = sum(e["generation"] == 2 for e in late)
        out["  hand-off less GC"] = out["hand-off to next()"] - out["  GC during hand-off"]
    out["#GETs before batch (all)"] = len(gets)
    out["batches 2-5 (after the first)"] = c["t_fifth"] - end
    out["#full GCs in batches 2-5"] = sum(e["generation"] == 2 for e in evs if e["what"] == "gc"
                                           and e["pid"] == parent and end <= e["t0"] < c["t_fifth"])
    out["from Dataset() to batch"] = end - c["t_internals"]
    out["from Loader() to batch"] = end - c["t_ds"]
    out["from iter() to batch"] = end - t_iter
    out["from import to batch"] = end - c["t_start"]
    out["from import shardloader to batch"] = end - c["t_torch"]
    return out


def server_costs(at: Any, images: Any, n: int = 10) -> str:
    """What one GET costs on this server, sequential (nothing in flight beside it): a 16 KiB
    range of a shard (~11-15 MB object) and of its range sidecar (a small object), and 8 such
    shard ranges at once. Evidence for the spans round: moto reads the whole object per GET."""
    import concurrent.futures

    from shardloader.io.s3client import s3_reader

    reader = s3_reader(at.url("arrow"), at.fsspec_options())
    assert reader is not None
    with open(os.path.join(images.arrow_dir, "index.json")) as f:
        shard = json.load(f)["shards"][0]["path"]
    base = at.url("arrow")[len("s3://"):]

    def each(path: str) -> float:
        reader.cat_file(path, 0, 16384)  # a connection, warm
        t0 = time.perf_counter()
        for _ in range(n):
            reader.cat_file(path, 0, 16384)
        return (time.perf_counter() - t0) / n

    big, small = each(f"{base}/{shard}"), each(f"{base}/{shard}.ranges")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda i: reader.cat_file(f"{base}/{shard}", i * 16384, (i + 1) * 16384), range(8 * n)))
        eight = (time.perf_counter() - t0) / n
    return (f"server cost per GET (sequential, mean of {n}): 16 KiB of a shard {big * 1000:.1f} ms, "
            f"of a sidecar {small * 1000:.1f} ms; 8 shard ranges at once: {eight * 1000:.1f} ms per round")


# -- the table -------------------------------------------------------------------------------------

#: JPEG side lengths (min, max px) per layout; mean sizes measured on 200 samples, seed 0.
LAYOUTS = {"default": (128, 256), "issue": (112, 224)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", default="default", choices=sorted(LAYOUTS),
                        help="image sizes: 'default' 128-256 px (~14.3 KiB), 'issue' 112-224 px "
                             "(~11.4 KiB, issue 24's ~11 KiB JPEGs)")
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--user-seconds", type=float, default=0.0,
                        help="sleep this long between Loader() and iter() (a script's model set-up)")
    parser.add_argument("--sources", action="store_true",
                        help="the goal table instead: the cold first batch per S3 credential "
                             "source beside mosaicml-streaming, and locally beside DataLoader "
                             "(benchmarks.coldstart_sources; --images defaults to 4000 there)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sources:
        from benchmarks import coldstart_sources

        images = [] if args.images == 20_000 else ["--images", str(args.images)]
        coldstart_sources.main([*images, "--repeats", str(args.repeats)])
        return
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return

    from benchmarks._common import compile_library, load_average
    from benchmarks._images import describe, prepare_images
    from benchmarks._s3 import S3Process

    images = prepare_images(args.images, min_size=LAYOUTS[args.layout][0], max_size=LAYOUTS[args.layout][1])
    compile_library()  # fresh processes import compiled modules, as an installed package's
    workers = [int(w) for w in args.workers.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in workers}
    print(f"# cold first batch from S3 (moto on loopback, empty cache, fresh process per try); "
          f"{args.user_seconds:g} s between Loader() and iter()\n"
          f"{describe(images)}; batch {BATCH}, shuffled, Compose([DecodeCropFlip({SIZE}), ToTensor()]); "
          f"{load_average()}", flush=True)
    with S3Process({"arrow": images.arrow_dir}) as server:
        print(server_costs(server.at, images), flush=True)
        for r in range(args.repeats):
            for w in workers:
                got = run_try({"url": server.at.url("arrow"), "endpoint": server.at.endpoint, "workers": w,
                               "user_seconds": args.user_seconds},
                              server.at.env())
                runs[w].append(got)
                print(f"  try {r + 1}, {w} workers: {got['from Dataset() to batch']:.3f} s from Dataset(), "
                      f"{got['from import to batch']:.3f} s from import", flush=True)
    keys: list[str] = []
    for w in workers:
        for got in runs[w]:
            keys += [k for k in got if k not in keys]
    head = f"{'phase (median of ' + str(args.repeats) + ')':44s}" + "".join(f"{f'{w} workers':>14}" for w in workers)
    print("\n" + head + "\n" + "-" * len(head))
    for k in keys:
        cells = []
        for w in workers:
            vals = [got[k] for got in runs[w] if k in got]
            if not vals:
                cells.append(f"{'-':>14}")
                continue
            m = statistics.median(vals)
            seconds = not (k.startswith("#") or "MB" in k or "max" in k or k.startswith("shards"))
            cells.append(f"{m * 1000:11.1f} ms" if seconds else f"{m:14.1f}")
        print(f"{k:44s}" + "".join(cells))
    print(f"\nload while measuring: {load_average()} (2 shared cores: medians, noisy)\ngoal: <= 0.4 s to the first batch")


if __name__ == "__main__":
    main()
