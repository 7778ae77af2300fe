"""benchmarks/_measure.py: tree-wide memory from /proc, against a process tree this test starts
(a child and a grandchild that each hold a known amount of touched memory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks._measure import PeakMemory, process_memory, tree_memory, tree_pids

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
    rss_parent, pss_parent = process_memory(parent)
    rss_child, pss_child = process_memory(child)
    assert rss_parent >= 96 * MiB and rss_child >= 48 * MiB
    assert 0 < pss_parent <= rss_parent and 0 < pss_child <= rss_child
    assert pss_parent >= 96 * MiB  # the written block is private: all of it counts in PSS
    rss, pss, n = tree_memory(proc.pid)
    assert n == 2
    assert rss >= 144 * MiB and pss >= 144 * MiB


def test_the_peak_holds_the_largest_sums_seen(tree):
    proc, _ = tree
    sampler = PeakMemory(proc.pid)
    sampler.sample()  # synchronously: the tree is at its full size now
    peak = sampler.result
    assert peak.rss >= 144 * MiB and peak.pss >= 144 * MiB and peak.processes == 2
    with PeakMemory(proc.pid, interval=0.01) as running:
        pass
    assert running.result.samples >= 1 and running.result.rss >= 144 * MiB


def test_a_process_that_is_gone_counts_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    assert process_memory(proc.pid) == (0, 0)
    assert tree_memory(proc.pid)[:2] == (0, 0)
