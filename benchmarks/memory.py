"""Memory (peak RSS and PSS over the whole process tree) and local first-batch latency:
shardloader's `Loader` against torch's `DataLoader` on the same images and the same work.

The work is `benchmarks.peers`' (same JPEGs from `benchmarks/_images.py`, `DecodeCropFlip(112)`
per sample, batch 64, 2 workers, shuffled): shardloader reads the Arrow shards, DataLoader the
image files. Each run is a fresh Python process (so one loader's imports never count for the
other) that imports torch and the loader's top-level module, then times construction -> first
batch, then consumes `--batches` batches (default: the whole epoch) and exits. This process
samples every process of that run's tree (the run's main process and each worker) every
`--interval` seconds from /proc/<pid>/smaps_rollup, outside the measured tree:

* peak RSS and peak PSS of the tree: the maximum over samples of the sum over its processes.
  RSS counts a page shared by N processes N times (file-backed mmaps of shards, the
  copy-on-write pages a forked worker shares with its parent); PSS counts 1/N of it in each,
  so the tree's PSS is what the run really costs the machine;
* per process (role main / worker i): peak RSS and PSS, and PSS split into anonymous (heap,
  Python objects), file-backed (shared libraries, mapped shards) and shmem (shared-memory batch
  slots; torch's shared tensors), plus VmHWM (the kernel's own RSS high-water mark, which sees
  peaks between samples), threads, and which heavy libraries the process has mapped.

Shared memory that no process maps is in neither sum: torch DataLoader's workers hand each
batch over as a shared-memory file whose descriptor travels through a pipe, so its queued
batches (prefetch_factor x workers, 4 x 2.3 MiB here) are mapped by no process until the
training process unpickles them; shardloader's batch slots are mapped by the processes that use
them and count in their PSS. The table therefore also gives the growth of the machine's Shmem
(/proc/meminfo) over the run: it sees both kinds, but also any other process's shared memory,
so read it on a quiet machine (medians over alternating rounds).

Sampling starts once the run's first batch is out (reading smaps_rollup slows the target's
start: see `_measure`); VmHWM still covers the start, and the peaks come later anyway.

Runs alternate between the loaders (A B, B A, ...) so that load from other processes on the
shared machine hits both alike; the table gives medians over `--rounds` rounds.

    python -m benchmarks.memory                      # 20k images, whole epoch, 3 rounds
    python -m benchmarks.memory --n 5000 --batches 40 --rounds 5
    python -m benchmarks.memory --only shardloader --rounds 1   # one loader's breakdown
    python -m benchmarks.memory --baseline-src /tmp/old/src     # also shardloader from there

`--baseline-src` adds a third loader: shardloader imported from another source tree (e.g. a
`git archive` of an older commit), so a change is measured before/after in the same run.

`--remote`: the same work read from S3 instead of local files, against the peers that read
S3 (issue 24: "peak RSS, remote ... goal <= best remote peer"): moto's S3 server on 127.0.0.1
in a process of its own (`benchmarks/_s3.py`, outside the measured tree) holds the Arrow
shards and mosaicml-streaming's MDS shards (and litdata's chunks, with `--only ... litdata`);
each run starts from a fresh, empty local cache, so its peaks include downloading. Loaders:
shardloader's `Loader` over `s3://` (its node cache) and mosaicml-streaming's
`StreamingDataset` + `StreamingDataLoader` (`benchmarks.peers`' adapters, as in
`benchmarks/speed.py`'s cold start). Run it from the benchmark venv, which has the peers:

    .venv-bench/bin/python -m benchmarks.memory --remote --n 20000 --rounds 3   # ~2.5 min

A whole epoch of the 20k set, so that what downloading leaves in the training process shows
(with 30 batches of 3k images most shards are still on their way).

`--step-ms`: the loop waits that long per batch, as a training step on a GPU makes it (by
default it only takes batches, so the workers never wait for it: the pipeline is the workers').
With a step longer than a batch takes to make, the workers wait between tasks, as they mostly do
in training.

The measured tree is the run's process and all its descendants (a loader's helper processes,
and their children, count).

`run(...)` returns the figures as a dict for other benchmark scripts (see `benchmarks.run_all`).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import load_average, machine, table, tree_pids
from benchmarks._measure import StderrMark, smaps_rollup

LOADERS = ("shardloader", "dataloader")
#: The loaders of `--remote` (reading S3); each has a layout on the server (see `_layouts`).
REMOTE_LOADERS = ("shardloader", "mosaic", "litdata")
REMOTE_DEFAULT = ("shardloader", "mosaic")
LABELS = {"shardloader": "shardloader Loader (Arrow)", "dataloader": "torch DataLoader (files)",
          "baseline": "shardloader Loader, --baseline-src",
          "mosaic": "mosaicml-streaming (MDS)", "litdata": "litdata (chunks)"}
REMOTE_LABELS = {"shardloader": "shardloader Loader (Arrow, S3)",
                 "baseline": "shardloader Loader, --baseline-src (S3)",
                 "mosaic": "mosaicml-streaming (MDS, S3)", "litdata": "litdata (chunks, S3)"}
#: The peer each remote run compares shardloader with (the issue's goal: <= the best of them).
_PEERS = ("dataloader", "mosaic", "litdata")
#: Libraries whose shared objects in a process's address space tell what it imported.
_LIBRARIES = ("pandas", "cv2", "pyarrow", "mlflow", "simplejpeg", "PIL", "numpy", "torch",
              "scipy", "sqlalchemy", "xxhash", "fsspec")
_ROLLUP_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
_MIB = 1024.0  # smaps values are in kB
_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


# -- the measured process ---------------------------------------------------------------------


def _child(which: str, n: int, batches: int, workers: int, endpoint: str | None = None,
           cache_dir: str | None = None, step_s: float = 0.0) -> None:
    """One measured run (in its own process): prints a JSON line with its timings. With
    `endpoint`, the loader reads from that S3 server into `cache_dir` (empty); with `step_s`,
    the loop spends that long on each batch (a training step: see `--step-ms`)."""
    import torch  # noqa: F401 - what a training script has imported before it builds a loader

    from benchmarks import peers
    from benchmarks._images import prepare_images

    images = prepare_images(n, log=lambda _: None)
    peers.WORKERS = workers
    remote = None
    if endpoint:
        from benchmarks._s3 import S3Endpoint

        remote = peers.Remote(S3Endpoint(endpoint), cache_dir or "")
    if which == "shardloader":
        from shardloader import Dataset, Loader  # noqa: F401 - top-level names, loaded now

        peer = peers.shardloader_peer(images, remote=remote)
    elif which == "mosaic":
        peer = peers.mosaic_peer(images, remote=remote)
    elif which == "litdata":
        peer = peers.litdata_peer(images, remote=remote)
    else:
        peer = peers.dataloader_peer(images)
    _mark("start")
    start = time.perf_counter()
    loader = peer.make()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    _mark("first")
    count = 1
    t1 = time.perf_counter()
    for _ in it:
        count += 1
        if step_s:
            time.sleep(step_s)  # the step runs elsewhere (a GPU): this process waits
        if batches and count >= batches:
            break
    rest = time.perf_counter() - t1
    _mark("end")
    del it
    peer.close(loader)
    print(json.dumps({"first_batch_s": first, "batches": count, "rest_s": rest}), flush=True)


def _mark(what: str) -> None:
    """Tell the sampling process which phase the run is in (a line on stderr)."""
    print(f"@phase {what}", file=sys.stderr, flush=True)


# -- sampling ---------------------------------------------------------------------------------


def _rollup(pid: int) -> dict[str, int] | None:
    """Rss/Pss fields (kB) of /proc/<pid>/smaps_rollup plus VmHWM and Threads from its status,
    or None once the process is gone."""
    rollup = smaps_rollup(pid)
    if rollup is None:
        return None
    values = {name: rollup[name] for name in _ROLLUP_FIELDS if name in rollup}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "Threads:")):
                    name, rest = line.split(":", 1)
                    values[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return values


def _libraries(pid: int) -> list[str]:
    """Which of `_LIBRARIES` have shared objects mapped into process `pid`."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except OSError:
        return []
    found = []
    for lib in _LIBRARIES:
        if f"/{lib}/" in text or f"/{lib}." in text or f"/lib{lib}" in text:
            found.append(lib)
    return found


@dataclass
class ProcessPeak:
    role: str
    peak: dict[str, int] = field(default_factory=dict)
    libraries: list[str] = field(default_factory=list)

    def update(self, values: dict[str, int]) -> None:
        for k, v in values.items():
            self.peak[k] = max(self.peak.get(k, 0), v)


@dataclass
class RunResult:
    which: str
    first_batch_s: float
    batches: int
    rest_s: float
    peak_rss_mib: float
    peak_pss_mib: float
    processes: list[ProcessPeak]
    samples: int
    shmem_growth_mib: float = 0.0


def _machine_shmem() -> int:
    """The machine's Shmem (kB, /proc/meminfo): shared memory whether or not a process maps it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Shmem:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _measure(which: str, n: int, batches: int, workers: int, interval: float,
             baseline_src: str | None = None, s3: Any = None, step_ms: float = 0.0) -> RunResult:
    """Run one measured process and sample its tree until it exits. With `s3` (an
    `benchmarks._s3.S3Endpoint`), the loader reads from there into a fresh empty cache."""
    child = "shardloader" if which == "baseline" else which
    cmd = [sys.executable, "-m", "benchmarks.memory", "--child", child, "--n", str(n),
           "--batches", str(batches), "--workers", str(workers), "--step-ms", str(step_ms)]
    # Bytecode caches as an installed package has them (a dev shell that sets
    # PYTHONDONTWRITEBYTECODE would have every run compile shardloader's sources again).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cache = None
    if s3 is not None:
        cache = tempfile.mkdtemp(prefix=f"memory-{which}-", dir=_OUT)
        cmd += ["--endpoint", s3.endpoint, "--cache-dir", cache]
        env.update(s3.env())  # mosaicml-streaming reads the endpoint and keys from there
    try:
        return _sample(which, cmd, env, interval, baseline_src)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


def _sample(which: str, cmd: list[str], env: dict[str, str], interval: float,
            baseline_src: str | None) -> RunResult:
    """Start `cmd` and sample its process tree until it exits."""
    if which == "baseline":
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(baseline_src or ""), root])
    shmem_before = _machine_shmem()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"})
    # The child's stderr is read on a thread: its phase marks tell when the first batch is out.
    # Sampling starts only then: reading smaps_rollup takes the target's mmap lock, and at 50 Hz
    # over three processes it slowed the forks and library loads of the start (first batch
    # 0.26-0.53 s sampled, ~0.17 s not). The run's peaks come later, as the workers read.
    assert proc.stderr is not None
    marks = StderrMark(proc.stderr, "@phase first")
    roles: dict[int, ProcessPeak] = {}
    peak_rss = peak_pss = peak_shmem = 0
    samples = 0
    marks.reached.wait()
    while proc.poll() is None:
        total_rss = total_pss = 0
        tree = [(proc.pid, "main")] + [(c, "") for c in tree_pids(proc.pid)[1:]]
        seen = 0
        for pid, role in tree:
            values = _rollup(pid)
            if values is None:
                continue
            seen += 1
            entry = roles.get(pid)
            if entry is None:
                entry = roles[pid] = ProcessPeak(role or f"worker {len(roles) - 1}")
            entry.update(values)
            if samples % 10 == 0 or not entry.libraries:
                entry.libraries = _libraries(pid) or entry.libraries
            total_rss += values["Rss"]
            total_pss += values.get("Pss", 0)
        if seen:
            samples += 1
            peak_rss, peak_pss = max(peak_rss, total_rss), max(peak_pss, total_pss)
            peak_shmem = max(peak_shmem, _machine_shmem())
        time.sleep(interval)
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait()
    err = marks.text()
    if proc.returncode != 0:
        raise RuntimeError(f"{which} run failed (exit {proc.returncode}):\n{err[-3000:]}")
    figures = json.loads(out.strip().splitlines()[-1])
    return RunResult(which, figures["first_batch_s"], figures["batches"], figures["rest_s"],
                     peak_rss / _MIB, peak_pss / _MIB, list(roles.values()), samples,
                     max(0, peak_shmem - shmem_before) / _MIB)


# -- the report -------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _breakdown(result: RunResult) -> str:
    rows = []
    for p in result.processes:
        k = p.peak
        rows.append([p.role, k.get("Rss", 0) / _MIB, k.get("Pss", 0) / _MIB,
                     k.get("Pss_Anon", 0) / _MIB, k.get("Pss_File", 0) / _MIB,
                     k.get("Pss_Shmem", 0) / _MIB, k.get("VmHWM", 0) / _MIB, k.get("Threads", 0),
                     " ".join(p.libraries) or "-"])
    return table(["process", "peak RSS MiB", "peak PSS MiB", "PSS anon", "PSS file", "PSS shmem",
                  "VmHWM MiB", "threads", "libraries mapped"], rows)


def run(n: int = 20_000, *, batches: int = 0, rounds: int = 3, workers: int = 2,
        interval: float = 0.02, only: list[str] | None = None, baseline_src: str | None = None,
        remote: bool = False, step_ms: float = 0.0,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure, print the table and the per-process breakdown, and return the figures. With
    `remote`, every loader reads from moto's S3 (see the module's docstring)."""
    from benchmarks._images import describe, prepare_images

    images = prepare_images(n, log=log)
    choices = REMOTE_LOADERS if remote else LOADERS
    default = REMOTE_DEFAULT if remote else LOADERS
    names = [w for w in (choices if only else default) if not only or w in only]
    names += ["baseline"] if baseline_src else []
    labels = REMOTE_LABELS if remote else LABELS
    log(f"{describe(images)}; {machine()}; {load_average()}")
    log(f"work: DecodeCropFlip(112), batch 64, {workers} workers, "
        f"{'whole epoch' if not batches else f'{batches} batches'}; {rounds} alternating rounds"
        f"{'; from S3 (moto on loopback), each run with an empty cache' if remote else ''}"
        f"{f'; a {step_ms:g} ms step per batch' if step_ms else '; no step (the loop only takes batches)'}")

    def measure(which: str, s3: Any = None) -> RunResult:
        return _measure(which, n, batches, workers, interval, baseline_src, s3, step_ms)

    if not remote:
        runs = _rounds(names, rounds, measure, log)
    else:
        from benchmarks._s3 import S3Process

        layouts = _layouts(images, names, log)
        log(f"starting moto S3 and uploading {', '.join(layouts)} ...")
        with S3Process(layouts) as server:
            runs = _rounds(names, rounds, lambda which: measure(which, server.at), log)
    figures = _report(runs, labels, log)
    for which in names:
        log(f"\n{labels[which]}, per process (last round; peaks over the run):\n")
        log(_breakdown(runs[which][-1]))
    log(f"\n{load_average()}")
    return figures


def _layouts(images: Any, names: list[str], log: Callable[[str], None]) -> dict[str, str]:
    """The folders the S3 server holds for these loaders (layout name -> local folder)."""
    layouts = {"arrow": images.arrow_dir}
    if "mosaic" in names:
        from benchmarks._images import prepare_mds

        layouts["mds"] = prepare_mds(images, log=log)
    if "litdata" in names:
        from benchmarks._images import prepare_litdata

        layouts["litdata"] = prepare_litdata(images, log=log)
    return layouts


def _rounds(names: list[str], rounds: int, measure: Callable[[str], RunResult],
            log: Callable[[str], None]) -> dict[str, list[RunResult]]:
    """Every loader once per round, in alternating order (A B, B A, ...)."""
    runs: dict[str, list[RunResult]] = {w: [] for w in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for which in order:
            result = measure(which)
            runs[which].append(result)
            log(f"  round {r + 1} {which}: first batch {result.first_batch_s:.3f} s, peak RSS "
                f"{result.peak_rss_mib:,.0f} MiB (PSS {result.peak_pss_mib:,.0f}), machine Shmem "
                f"+{result.shmem_growth_mib:,.1f} MiB, {result.batches} batches, "
                f"{len(result.processes)} processes, {result.samples} samples of the tree")
    return runs


def _report(runs: dict[str, list[RunResult]], labels: dict[str, str],
            log: Callable[[str], None]) -> dict[str, Any]:
    """The medians' table and shardloader's ratios to each peer; the medians by loader."""
    rows, figures = [], {}
    for which, rs in runs.items():
        f = {"first_batch_s": _median([x.first_batch_s for x in rs]),
             "peak_rss_mib": _median([x.peak_rss_mib for x in rs]),
             "peak_pss_mib": _median([x.peak_pss_mib for x in rs]),
             "shmem_growth_mib": _median([x.shmem_growth_mib for x in rs]),
             "first_batch_all": [round(x.first_batch_s, 4) for x in rs]}
        figures[which] = f
        rows.append([labels[which], f["peak_rss_mib"], f["peak_pss_mib"], f["shmem_growth_mib"],
                     f["first_batch_s"],
                     " ".join(f"{x:.3f}" for x in f["first_batch_all"])])
    log("")
    log(table(["loader", "peak RSS MiB (tree)", "peak PSS MiB (tree)",
               "machine Shmem growth MiB", "first batch s (median)",
               "first batch s (runs)"], rows))
    for mine in ("shardloader", "baseline"):
        for peer in (p for p in _PEERS if p in figures and mine in figures):
            a, b = figures[mine], figures[peer]
            log(f"\n{labels[mine]} / {labels[peer]}: peak RSS "
                f"{a['peak_rss_mib'] / b['peak_rss_mib']:.2f}x, peak PSS "
                f"{a['peak_pss_mib'] / b['peak_pss_mib']:.2f}x, first batch "
                f"{a['first_batch_s'] / b['first_batch_s']:.2f}x")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="images in the set")
    parser.add_argument("--batches", type=int, default=0, help="batches per run (0: whole epoch)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    parser.add_argument("--only", nargs="*", choices=sorted({*LOADERS, *REMOTE_LOADERS}),
                        help=f"which loaders (local: {', '.join(LOADERS)}; --remote: "
                             f"{', '.join(REMOTE_LOADERS)})")
    parser.add_argument("--baseline-src", help="also run shardloader imported from this src folder")
    parser.add_argument("--remote", action="store_true",
                        help="read from S3 (moto on loopback) against the S3 peers")
    parser.add_argument("--child", choices=sorted({*LOADERS, *REMOTE_LOADERS}),
                        help=argparse.SUPPRESS)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="ms the loop waits per batch, as for a training step on a GPU "
                             "(0: none, the workers never wait for the loop)")
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.n, args.batches, args.workers, args.endpoint, args.cache_dir,
               args.step_ms / 1000)
        return
    choices = REMOTE_LOADERS if args.remote else LOADERS
    if args.only and not set(args.only) <= set(choices):
        parser.error(f"--only: {'--remote' if args.remote else 'local'} runs take {', '.join(choices)}")
    run(args.n, batches=args.batches, rounds=args.rounds, workers=args.workers,
        interval=args.interval, only=args.only, baseline_src=args.baseline_src,
        remote=args.remote, step_ms=args.step_ms)


if __name__ == "__main__":
    main()
