"""What a loader costs its whole process tree, read from Linux /proc: memory (RSS and PSS summed
over a process and its descendants, sampled while it runs) and CPU (`_common.tree_cpu_seconds`).

A loader's cost is spread over processes: the training process, its worker processes, their
helpers. Summing RSS double-counts pages the workers share with the parent after fork (torch,
numpy, the imported code); PSS divides each shared page among the processes that map it, so
the PSS sum is what the tree really takes from the machine. Both are reported, as the issue's
table does.

`PeakMemory` polls from a thread of the *measuring* process, so the measured tree carries no
sampler of its own. Polling every `interval` seconds can miss a spike shorter than that; the
loaders' memory grows with imports, worker start-up and in-flight batches, which last far
longer than the default 20 ms. It should start once the measured process's start is over:
reading smaps_rollup takes the target's mmap lock, and sampling through a start slows its forks
and page faults (`StderrMark` tells when a child says its start is over).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks._common import tree_pids

_FIELDS = {"Rss": "rss", "Pss": "pss", "Pss_Anon": "pss_anon"}


def smaps_rollup(pid: int) -> dict[str, int] | None:
    """Every field of /proc/<pid>/smaps_rollup that is a size, in kB by its name ("Rss",
    "Pss_Anon", ...), or None once the process is gone (a zombie's rollup is empty)."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if rest.rstrip().endswith("kB"):
                    values[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return values if "Rss" in values else None


def process_memory(pid: int) -> dict[str, int]:
    """{"rss", "pss", "pss_anon"} of one process in bytes, from /proc/<pid>/smaps_rollup; zeros
    when it is gone (or is a zombie, whose rollup is empty). `pss_anon` is the part of PSS
    that is not file-backed (heap, arrays): mapped files such as memory-mapped shards count in
    RSS and PSS but are page cache the kernel can drop."""
    rollup = smaps_rollup(pid) or {}
    return {key: rollup.get(name, 0) * 1024 for name, key in _FIELDS.items()}


def tree_memory(root: int) -> dict[str, int]:
    """{"rss", "pss", "pss_anon", "processes"} summed over `root` and its descendants now."""
    pids = tree_pids(root)
    total = dict.fromkeys(_FIELDS.values(), 0)
    for pid in pids:
        for key, value in process_memory(pid).items():
            total[key] += value
    return {**total, "processes": len(pids)}


@dataclass
class Peak:
    """The largest tree-wide sums seen (each maximised on its own), and how many samples."""

    rss: int = 0
    pss: int = 0
    pss_anon: int = 0
    processes: int = 0
    samples: int = 0


class PeakMemory:
    """Samples `tree_memory(root)` every `interval` seconds in a daemon thread until `stop()`.

        with PeakMemory(proc.pid) as peak:
            proc.wait()
        peak.result.rss, peak.result.pss
    """

    def __init__(self, root: int, interval: float = 0.02) -> None:
        self.root, self.interval = root, interval
        self.result = Peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        now, r = tree_memory(self.root), self.result
        r.rss, r.pss = max(r.rss, now["rss"]), max(r.pss, now["pss"])
        r.pss_anon, r.processes = max(r.pss_anon, now["pss_anon"]), max(r.processes, now["processes"])
        r.samples += 1

    def start(self) -> PeakMemory:
        self._thread.start()
        return self

    def stop(self) -> Peak:
        self._stop.set()
        self._thread.join(10)
        return self.result

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StderrMark:
    """A child process's stderr, read on a thread of this process: its lines are kept (for an
    error message), and `reached` is set once a line starts with `mark` (or the stream ends).

    This is how a benchmark learns that a child's first batch is out without polling the
    child, so that `PeakMemory` can start then."""

    def __init__(self, stream: Iterable[str], mark: str) -> None:
        self.lines: list[str] = []
        self.reached = threading.Event()
        self._mark = mark
        self._thread = threading.Thread(target=self._read, args=(stream,), name="child-stderr",
                                        daemon=True)
        self._thread.start()

    def _read(self, stream: Iterable[str]) -> None:
        for line in stream:
            self.lines.append(line)
            if line.startswith(self._mark):
                self.reached.set()
        self.reached.set()  # the child closed it: it exited, or failed before the mark

    def text(self, timeout: float = 10.0) -> str:
        """All of it, once the stream has ended (what came, if it has not within `timeout`)."""
        self._thread.join(timeout)
        return "".join(self.lines)


def tree_footprint(root: int) -> int:
    """Bytes the tree of `root` would take from a machine it ran on alone: its processes'
    anonymous PSS (anonymous pages are shared only by fork, within the tree) plus each mapped
    file's resident pages once (the largest Rss of that file in any process of the tree).
    Unlike the tree's PSS, other processes mapping the same libraries (another job's torch from
    the same environment, on a shared machine) do not lower it."""
    anon, files = 0, {}
    for pid in tree_pids(root):
        rollup = smaps_rollup(pid) or {}
        anon += rollup.get("Pss_Anon", 0)
        per_file: dict[str, int] = {}
        try:
            with open(f"/proc/{pid}/smaps") as f:
                path = ""
                for line in f:
                    head = line.split()
                    if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                        path = head[5] if len(head) >= 6 and head[5].startswith("/") else ""
                    elif path and head and head[0] == "Rss:":
                        per_file[path] = per_file.get(path, 0) + int(head[1])
        except OSError:
            continue
        for path, kb in per_file.items():
            files[path] = max(files.get(path, 0), kb)
    return (anon + sum(files.values())) * 1024
