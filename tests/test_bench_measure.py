"""benchmarks/_measure.py: tree-wide memory from /proc, against a process tree this test starts
(a child and a grandchild that each hold a known amount of touched memory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks._common import tree_pids
from benchmarks._measure import PeakMemory, StderrMark, process_memory, tree_memory

MiB = 1 << 20

# Holds `mb` MiB of written (so resident, private) memory, optionally starts a copy of itself
# holding `child_mb`, prints "ready <pids>" once all of it is resident, exits when stdin closes.
HOLDER = textwrap.dedent("""
    import subprocess, sys
    mb, child_mb = int(sys.argv[1]), int(sys.argv[2])
    block = bytearray(mb << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    pids = []
    if child_mb:
        child = subprocess.Popen([sys.executable, "-c", sys.argv[3], str(child_mb), "0", ""],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        pids = child.stdout.readline().split()[1:]
    import os
    print("ready", os.getpid(), *pids, flush=True)
    sys.stdin.read()
    if child_mb:
        child.stdin.close()
        child.wait(30)
""")


@pytest.fixture
def tree():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, "96", "48", HOLDER],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    words = proc.stdout.readline().split()
    assert words[0] == "ready", words
    yield proc, [int(p) for p in words[1:]]
    proc.stdin.close()
    proc.wait(30)


def test_the_tree_is_the_process_and_its_descendants(tree):
    proc, pids = tree
    assert len(pids) == 2 and pids[0] == proc.pid
    assert sorted(tree_pids(proc.pid)) == sorted(pids)
    assert tree_pids(pids[1]) == [pids[1]]  # a leaf is its own tree


def test_memory_sums_over_the_tree(tree):
    proc, (parent, child) = tree
    p, c = process_memory(parent), process_memory(child)
    assert p["rss"] >= 96 * MiB and c["rss"] >= 48 * MiB
    assert 0 < p["pss"] <= p["rss"] and 0 < c["pss"] <= c["rss"]
    # the written block is private and anonymous: all of it counts in PSS and in its anon part
    assert p["pss_anon"] >= 96 * MiB and c["pss_anon"] >= 48 * MiB
    assert p["pss_anon"] <= p["pss"]
    total = tree_memory(proc.pid)
    assert total["processes"] == 2
    assert total["rss"] >= 144 * MiB and total["pss"] >= 144 * MiB
    assert total["rss"] == pytest.approx(p["rss"] + c["rss"], rel=0.05)


def test_the_peak_holds_the_largest_sums_seen(tree):
    proc, _ = tree
    sampler = PeakMemory(proc.pid)
    sampler.sample()  # synchronously: the tree is at its full size now
    peak = sampler.result
    assert peak.rss >= 144 * MiB and peak.pss >= 144 * MiB and peak.processes == 2
    assert peak.pss_anon >= 144 * MiB
    with PeakMemory(proc.pid, interval=0.01) as running:
        pass
    assert running.result.samples >= 1 and running.result.rss >= 144 * MiB


def test_a_process_that_is_gone_counts_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert process_memory(proc.pid) == {"rss": 0, "pss": 0, "pss_anon": 0}
    assert tree_memory(proc.pid)["rss"] == 0


# Writes "before" and then `sys.argv[1]` (if any) to stderr, waits until stdin closes, then
# writes "after" and exits.
MARKER = textwrap.dedent("""
    import sys
    print("before", file=sys.stderr, flush=True)
    if sys.argv[1]:
        print(sys.argv[1], "and more", file=sys.stderr, flush=True)
    sys.stdin.read()
    print("after", file=sys.stderr, flush=True)
""")


def test_the_stderr_mark_is_seen_while_the_child_still_runs_and_every_line_is_kept():
    proc = subprocess.Popen([sys.executable, "-c", MARKER, "@first-batch"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    marks = StderrMark(proc.stderr, "@first-batch")
    assert marks.reached.wait(30)
    assert proc.poll() is None  # the mark, not the end of the stream: the child waits for stdin
    proc.stdin.close()
    proc.wait(30)
    assert marks.text() == "before\n@first-batch and more\nafter\n"


def test_a_child_that_never_writes_the_mark_sets_it_when_its_stderr_ends():
    proc = subprocess.Popen([sys.executable, "-c", MARKER, ""], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    marks = StderrMark(proc.stderr, "@first-batch")
    proc.stdin.close()
    assert marks.reached.wait(30)
    proc.wait(30)
    assert marks.text() == "before\nafter\n"
