"""benchmarks/_measure.py: tree-wide memory from /proc, against a process tree this test starts
(a child and a grandchild that each hold a known amount of touched memory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks._common import tree_pids
from benchmarks._measure import PeakMemory, process_memory, tree_memory

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
