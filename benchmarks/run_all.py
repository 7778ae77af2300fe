"""`make bench`: run every benchmark and write benchmarks/results.md.

Each benchmark prints its own figures and ratios to the peers it measured in the same run;
this script runs them one after another (never in parallel: they would measure each other),
and collects what they print, with the date and the machine, into one Markdown file.

    python benchmarks/run_all.py                 # all
    python benchmarks/run_all.py throughput cache  # some
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = {
    "read_rows": ["-m", "benchmarks.read_rows"],
    "decode": ["-m", "benchmarks.decode"],
    "resume_cost": ["-m", "benchmarks.resume_cost"],
    "mixing": ["-m", "benchmarks.mixing"],
    "throughput": ["-m", "benchmarks.throughput"],
    "peers": ["-m", "benchmarks.peers"],
    "speed": ["-m", "benchmarks.speed"],  # issue 14's table, beside FFCV and litdata
    "memory": ["-m", "benchmarks.memory"],  # per-process RSS/PSS breakdown beside DataLoader
    "cache": ["-m", "benchmarks.cache"],
    "telemetry_overhead": ["-m", "benchmarks.telemetry_overhead"],
    "checkpoint": ["-m", "benchmarks.checkpoint", "--sizes", "256M,1G"],
}


# Run with .venv-bench (`make bench` builds it): they measure the peer loaders installed there.
WITH_PEERS = {"peers", "speed"}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB RAM, Python {sys.version.split()[0]}"


def main() -> None:
    names = sys.argv[1:] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; known: {', '.join(BENCHMARKS)}")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"# Benchmark results\n\nRun {now} on {machine()}.\n"
             "Figures are medians of repeats; compare the ratios measured in the same run.\n"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    bench_python = os.path.join(ROOT, ".venv-bench", "bin", "python")  # peers live there
    for name in names:
        print(f"== {name}", flush=True)
        python = (bench_python if name in WITH_PEERS and os.path.exists(bench_python)
                  else sys.executable)
        start = time.perf_counter()
        proc = subprocess.run([python, *BENCHMARKS[name]], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        print(proc.stdout[-4000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
        status = "" if proc.returncode == 0 else f" — FAILED (exit {proc.returncode})"
        parts.append(f"## {name} ({seconds:.0f} s){status}\n\n```\n{proc.stdout.strip()}\n```\n")
    with open(os.path.join(ROOT, "benchmarks", "results.md"), "w") as f:
        f.write("\n".join(parts))
    print("wrote benchmarks/results.md")


if __name__ == "__main__":
    main()
