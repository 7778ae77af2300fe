"""Index scale: what a dataset of 10^3 ... 10^6 shards costs before the first sample is read.

For each shard count the benchmark fabricates a dataset whose `index.json` lists that many
Arrow shards, all with the same content: one real shard of a few tiny samples is written with
`write_shards`, and every index entry copies its counts, size and checksums under its own path
(``shard-0000000.arrow``, ...) and its own checksums (made up where no file is behind it, so the
checksum columns cost what a real dataset's do). Only the shards the first batches read exist on disk, as hard
links to that one file (and its range sidecar), so a 10^6-shard dataset takes a few MB; which
shards those are is computed with the loader's own order (`StepPlan`, the Loader's default
shuffle settings, seed 0, batch 64), so the run reads exactly the files that are there.

Each measurement is a fresh Python process (imports paid before anything is timed) that
prints, for one shard count and one `num_workers`:

* ``index``: the bytes of the index on disk (`index.json`, plus its shard table in the table
  form: ``--forms``, `shardloader.format.index_table`);
* ``open``: seconds in ``Dataset(root)`` (reading, parsing and validating the index);
* ``first``: seconds from ``Loader(ds, batch_size=64, shuffle=True, num_workers=w)`` to the
  first batch (with workers: their start included);
* ``main``: the training process's RSS after the first batch, and its growth over
  ``Dataset()`` alone (``main +open``): the index's own memory;
* ``worker``: with workers, one worker's RSS and its private bytes (Private_Clean +
  Private_Dirty in /proc/<pid>/smaps_rollup): pages it copied from its parent or allocated,
  shared with no other process. An index shared copy-on-write adds nothing here; one whose
  per-shard objects are touched (reference counts, the garbage collector) is copied into
  every worker;
  ``worker dirty`` is its Private_Dirty part alone (pages written: copied or allocated), and
  ``worker private B/shard`` the private bytes over the shard count (what the issue's goal,
  at most 100 bytes per shard, is read against; at small counts it is the interpreter's own);
  with ``--persistent`` (persistent workers) also its private bytes after the first batch of
  epochs 1 and 2 (``epoch 1``, ``epoch 2``): epoch 0's order the workers inherit from the
  training process, the later ones they build themselves;
* ``B/shard``: the slopes against the smallest count of the same run, i.e. what one more
  shard costs: ``(x(N) - x(N0)) / (N - N0)`` for the training process's ``+open`` growth and
  for a worker's private bytes.

``--baseline-src`` runs the same children with ``shardloader`` imported from another source
tree (e.g. a copy of `src/` before a change), alternating with this tree, so the two are
compared on the same fabricated datasets in one run.

    python -m benchmarks.scale                                # 10^3 ... 10^6, workers 0 and 2
    python -m benchmarks.scale --counts 1000,10000 --workers 0   # quick
    python -m benchmarks.scale --baseline-src /tmp/old/src --baseline-max 100000
    python -m benchmarks.scale --counts 1000,1000000 --forms table   # the table form only
    python -m benchmarks.scale --counts 1000,1000000 --forms table --workers 2 --persistent
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._common import child_pids, load_average, machine, table

BATCH = 64
SAMPLES_PER_SHARD = 4
#: Steps whose shards are made to exist: the first batch, the batches submitted with it
#: (prefetch_factor 2 x 2 workers) and margin.
_STEPS_MATERIALISED = 16
#: Epochs whose first `_STEPS_MATERIALISED` steps' shards exist: epochs 1, 2 for ``--persistent``.
_EPOCHS_MATERIALISED = 3
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- fabricating datasets -----------------------------------------------------------------------
def _real_shard(work: str) -> dict[str, Any]:
    """Write one real shard of tiny samples; its index entry (as parsed JSON)."""
    from shardloader import write_shards

    real = os.path.join(work, "real")
    if not os.path.exists(os.path.join(real, "index.json")):
        samples = [{"label": i, "data": bytes([i]) * 16} for i in range(SAMPLES_PER_SHARD)]
        write_shards(samples, real, shard_samples=SAMPLES_PER_SHARD, progress=False, overwrite=True)
    with open(os.path.join(real, "index.json")) as f:
        data = json.load(f)
    assert len(data["shards"]) == 1, data
    data["root"] = real
    return data


def _name(i: int) -> str:
    return f"shard-{i:07d}.arrow"


def _first_shards(count: int) -> list[int]:
    """Shards the Loader's first `_STEPS_MATERIALISED` batches of each of the first
    `_EPOCHS_MATERIALISED` epochs read (default shuffle, seed 0)."""
    import numpy as np

    from shardloader.loader.plan import StepPlan, first_shards
    from shardloader.order.shuffle import ShuffleSettings

    sizes = np.full(count, SAMPLES_PER_SHARD, dtype=np.int64)
    plan = StepPlan(sizes, 0, ShuffleSettings(shuffle=True), 0, 1, BATCH, "partial")
    read = {0}
    for epoch in range(_EPOCHS_MATERIALISED):
        read.update(first_shards(plan, epoch, range(_STEPS_MATERIALISED), range(count)))
    return sorted(read)


def fabricate(work: str, count: int) -> str:
    """A dataset root whose index lists `count` shards (see the module doc); reused if present."""
    root = os.path.join(work, f"n{count}-e{_EPOCHS_MATERIALISED}")
    index_path = os.path.join(root, "index.json")
    if os.path.exists(index_path):
        return root
    real = _real_shard(work)
    entry = real["shards"][0]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    ranges = entry["ranges"]
    exist = set(_first_shards(count))
    algorithm = entry["checksum"].split(":")[0]

    def line(i: int) -> str:
        # Shards that exist carry the real checksums; the others a distinct made-up one each,
        # so that the index's checksum columns cost what a real dataset's do.
        shard_sum, ranges_sum = ((entry["checksum"], ranges["checksum"]) if i in exist
                                 else (f"{algorithm}:{i:032x}", f"{algorithm}:{i + count:032x}"))
        return (f'{{"bytes": {entry["bytes"]}, "checksum": "{shard_sum}", "format": "{entry["format"]}", '
                f'"path": "{_name(i)}", "ranges": {{"bytes": {ranges["bytes"]}, "checksum": '
                f'"{ranges_sum}", "path": "{_name(i)}.ranges"}}, "samples": {entry["samples"]}}}')

    assert set(entry) == {"bytes", "checksum", "format", "path", "ranges", "samples"}, entry
    text = (f'{{"format": "shardloader-index", "version": 1, "schema": {json.dumps(real["schema"])},'
            f' "shards": [\n' + ",\n".join(line(i) for i in range(count)) + "\n]}\n")
    for i in sorted(exist):
        os.link(os.path.join(real["root"], entry["path"]), os.path.join(root, _name(i)))
        os.link(os.path.join(real["root"], ranges["path"]), os.path.join(root, _name(i) + ".ranges"))
    with open(index_path + ".tmp", "w") as f:
        f.write(text)
    os.replace(index_path + ".tmp", index_path)
    return root


def fabricate_table(work: str, count: int) -> str:
    """The dataset of `fabricate(work, count)` with its index in the table form
    (`shardloader.format.index_table`): same shards (hard links), index.json naming the table."""
    from shardloader.format.index import INDEX_NAME, Index, ShardInfo
    from shardloader.format.index_table import TABLE_NAME, table_form

    root = os.path.join(work, f"n{count}-e{_EPOCHS_MATERIALISED}-table")
    if os.path.exists(os.path.join(root, INDEX_NAME)):
        return root
    source = fabricate(work, count)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    for name in os.listdir(source):
        if name != INDEX_NAME:
            os.link(os.path.join(source, name), os.path.join(root, name))
    with open(os.path.join(source, INDEX_NAME)) as f:
        data = json.load(f)
    keys = ("path", "format", "samples", "bytes", "checksum")
    shards = [ShardInfo(*(e.pop(k) for k in keys), e) for e in data["shards"]]  # fabricated: valid
    document, table = table_form(Index(data["schema"], shards))
    with open(os.path.join(root, TABLE_NAME), "wb") as f:
        f.write(table)
    with open(os.path.join(root, INDEX_NAME + ".tmp"), "wb") as f:
        f.write(document)
    os.replace(os.path.join(root, INDEX_NAME + ".tmp"), os.path.join(root, INDEX_NAME))
    return root


def _disk_bytes(root: str) -> int:
    """Bytes of the index on disk: index.json, plus its shard table where it has one."""
    return sum(os.path.getsize(os.path.join(root, n)) for n in ("index.json", "index.shards.arrow")
               if os.path.exists(os.path.join(root, n)))


# -- one measurement (child process) ------------------------------------------------------------
def _status_bytes(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _private_bytes(pid: int, keys: tuple[str, ...] = ("Private_Clean:", "Private_Dirty:")) -> int:
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(keys):
                total += int(line.split()[1]) * 1024
    return total


def child(root: str, workers: int, persistent: bool = False) -> dict[str, Any]:
    import torch  # noqa: F401  (as a training process has: never counted as the index's)

    import shardloader
    from shardloader import Dataset, Loader

    before = _status_bytes("self", "VmRSS")
    start = time.perf_counter()
    ds = Dataset(root)
    opened = time.perf_counter() - start
    after_open = _status_bytes("self", "VmRSS")
    start = time.perf_counter()
    loader = Loader(ds, batch_size=BATCH, shuffle=True, num_workers=workers,
                    persistent_workers=persistent and workers > 0)
    it = iter(loader)
    batch = next(it)
    first = time.perf_counter() - start
    assert len(batch["label"]) == BATCH
    out: dict[str, Any] = {
        "src": os.path.dirname(os.path.dirname(shardloader.__file__)),
        "shards": ds.index.num_shards, "open_s": opened, "first_s": first,
        "main_rss": _status_bytes("self", "VmRSS"), "main_open_growth": after_open - before,
    }
    if workers:
        pids = [p for p in child_pids(os.getpid()) if _is_worker(p)]
        out["worker_rss"] = max(_status_bytes(p, "VmRSS") for p in pids)
        out["worker_private"] = max(_private_bytes(p) for p in pids)
        out["worker_dirty"] = max(_private_bytes(p, ("Private_Dirty:",)) for p in pids)
        if persistent:  # the same workers, epochs later: they build those orders themselves
            for epoch in (1, 2):
                loader.set_epoch(epoch)
                it = iter(loader)
                assert len(next(it)["label"]) == BATCH
                out[f"worker_private_epoch{epoch}"] = max(_private_bytes(p) for p in pids)
    del it
    loader.close() if hasattr(loader, "close") else None
    return out


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"python" in f.read()
    except OSError:
        return False


def _run_child(root: str, workers: int, src: str | None, timeout: float,
               persistent: bool = False) -> dict[str, Any]:
    env = dict(os.environ)
    paths = [p for p in (src, _REPO) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "benchmarks.scale", "--child", root, "--workers", str(workers)]
    if persistent:
        command.append("--persistent")
    proc = subprocess.run(command, env=env, cwd=_REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the table ----------------------------------------------------------------------------------
def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def _per_shard(n: float | None, shards: int) -> str:
    return "-" if n is None else f"{n / shards:,.0f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="1000,10000,100000,1000000")
    p.add_argument("--workers", default="0,2", help="num_workers values, comma-separated")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "shardloader-scale"),
                   help="where the fabricated datasets are kept (reused between runs)")
    p.add_argument("--baseline-src", default=None, help="also run shardloader imported from here")
    p.add_argument("--baseline-max", type=int, default=10**6,
                   help="largest shard count run with --baseline-src (an O(shards) index may not fit)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--forms", default="json,table",
                   help="index forms to run: json (shards listed in index.json), table (Arrow table)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--persistent", action="store_true",
                   help="persistent workers; also measure a worker's private bytes after the first "
                        "batch of epochs 1 and 2 (orders the workers build themselves)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, int(args.workers), args.persistent)))
        return
    counts = [int(c) for c in args.counts.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    sources: list[tuple[str, str | None]] = [("this tree", None)]
    if args.baseline_src:
        sources.append(("baseline", os.path.abspath(args.baseline_src)))
    results: list[dict[str, Any]] = []
    forms = args.forms.split(",")
    for count, form in [(c, f) for c in counts for f in forms]:
        start = time.perf_counter()
        root = fabricate(args.dir, count) if form == "json" else fabricate_table(args.dir, count)
        made = time.perf_counter() - start
        size = _disk_bytes(root)
        print(f"# {count} shards, {form}: index {size / 1e6:.1f} MB (fabricated in {made:.1f} s)",
              file=sys.stderr)
        for w in workers:
            for label, src in sources:
                if src is not None and count > args.baseline_max:
                    continue
                r = _run_child(root, w, src, args.timeout, args.persistent)
                r.update(code=f"{label} ({form})", count=count, workers=w, index_bytes=size)
                results.append(r)
                print(f"#   {label}, workers={w}: {r}", file=sys.stderr)
    rows = []
    for r in results:
        base = next((b for b in results if b["code"] == r["code"] and b["workers"] == r["workers"]
                     and b["count"] == counts[0] and "error" not in b), None)
        if "error" in r:
            rows.append([r["code"], r["count"], r["workers"], _mb(r["index_bytes"]), "error: " + r["error"]]
                        + [""] * 11)
            continue
        dn = r["count"] - counts[0]
        slope_main = slope_worker = "-"
        if base is not None and dn > 0:
            slope_main = f"{(r['main_open_growth'] - base['main_open_growth']) / dn:,.0f}"
            if "worker_private" in r:
                slope_worker = f"{(r['worker_private'] - base['worker_private']) / dn:,.0f}"
        rows.append([r["code"], r["count"], r["workers"], _mb(r["index_bytes"]), f"{r['open_s']:.3f}",
                     f"{r['first_s']:.3f}", _mb(r["main_rss"]), _mb(r["main_open_growth"]),
                     _mb(r.get("worker_rss")), _mb(r.get("worker_private")), _mb(r.get("worker_dirty")),
                     _per_shard(r.get("worker_private"), r["count"]), _mb(r.get("worker_private_epoch1")),
                     _mb(r.get("worker_private_epoch2")),
                     slope_main, slope_worker])
    print(f"\nIndex scale ({machine()}; {load_average()}); {SAMPLES_PER_SHARD} samples per shard, "
          f"batch {BATCH}, shuffle=True. MB = 10^6 bytes.\n")
    print(table(["code", "shards", "workers", "index MB", "open s", "first batch s", "main RSS MB",
                 "main +open MB", "worker RSS MB", "worker private MB", "worker dirty MB",
                 "worker private B/shard", "worker private MB, epoch 1", "epoch 2", "B/shard main",
                 "B/shard worker"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
