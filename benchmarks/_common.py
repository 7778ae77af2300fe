"""Small helpers shared by the benchmark scripts: timing, medians, tables, machine facts."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall seconds of `fn()` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rss_bytes() -> int:
    """Resident set size of this process now (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    cells = [[str(c) for c in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells[1:]]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def load_average() -> str:
    """The 1-minute load average and the core count, to judge how busy the machine was."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """`min-max` of the values, for a table cell."""
    if not values:
        return "-"
    return f"{_fmt(min(values))}-{_fmt(max(values))}"


def child_pids(pid: int) -> list[int]:
    """Direct child processes of `pid` (Linux /proc; any thread may be the parent)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant of it (through /proc/<pid>/task/*/children)."""
    seen: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo += child_pids(pid)
    return seen


def tree_cpu_seconds() -> dict[int, float]:
    """CPU seconds used so far by each process in this process's tree (this one included),
    keyed by pid. Subtract two snapshots to get what a loader and its workers used."""
    seen = {pid: _process_cpu(pid) for pid in tree_pids(os.getpid())}
    seen[os.getpid()] = time.process_time()  # finer than clock ticks for this process
    return seen


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two `tree_cpu_seconds()` snapshots by processes alive at the end
    (a process that started in between counts from zero)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def emit(text: str, results: Any, json_path: str | None) -> None:
    """Print a benchmark's report and, when asked, save its raw results as JSON."""
    print()
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


def compile_library() -> None:
    """Write shardloader's bytecode (`__pycache__`) before fresh processes are timed, as `pip
    install` does for an installed package. An editable checkout run with
    PYTHONDONTWRITEBYTECODE=1 (this machine's environment) compiled our ~100 modules from
    source in every fresh process, which the peers, installed and compiled, never pay: 0.1-0.15 s
    of a cold first batch with its imports here."""
    import compileall

    compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        "src", "shardloader"), quiet=1)
