"""Kill test: SIGKILL a training child at random instants during its saves; after each kill the
newest complete checkpoint verifies and restores exactly the state an uninterrupted run had at
that step (the child resumes from it on the next round, so resumes are checked too).

The stress version (at least 20 kills across every save phase) is tests/stress_checkpoint_kill.py,
not run by default."""

from __future__ import annotations

import random
import tempfile

from tests.fixtures.checkpoint import KILL_PHASES, kill_cycle, verify_after_kill

BIG = 1 << 16  # 256 KiB buffer in the model: the write phases take a little time


def test_sigkill_during_saves_leaves_a_complete_exact_checkpoint(tmp_path):
    root = str(tmp_path / "root")
    draw = random.Random(20260828)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if _has_shm() else None) as other_device:
        stagings = [None, other_device]  # rename into place, and copy across file systems
        steps = []
        for i, phase in enumerate(KILL_PHASES + ("write",)):
            report = kill_cycle(root, stagings[i % 2], phase=phase, occurrence=draw.randint(1, 3),
                                delay=draw.uniform(0, 0.003), big=BIG)
            assert report["rc"] == -9, report
            steps.append(verify_after_kill(root, stagings[i % 2], report, BIG))
    assert steps == sorted(steps) and steps[-1] > steps[0]


def _has_shm() -> bool:
    import os

    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
