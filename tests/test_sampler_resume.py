"""Issue 38: a training process that reads through a sampler, a batch sampler or a dataset with
a state is SIGKILLed mid-run; resumed from its last saved loader state, the batches — indices
and every sample's bytes — are exactly an uninterrupted run's, also with fewer workers and, for
the orders the Loader splits itself (pure samplers), a smaller world size.

The killed run is a child process (tests/sampler_train.py) with real worker processes, both
ranks of a world of 2 in one process where the case allows it (rank/world_size passed
explicitly; each step's samples in global order). The resumed run continues in this process,
with real worker processes too; the reference is the same loop read in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sampler_cases import WORLD_CHANGE
from tests.sampler_train import run

ROOT = Path(__file__).resolve().parent.parent
EPOCHS = 2

#: case -> (workers, world) of the killed run, the step after which it is killed, and the
#: workers of the resumed run (world size 1). Kill points fall inside epoch 0 or epoch 1.
CASES = {
    "own": ((2, 2), 3, 1),
    "weighted": ((2, 2), 8, 1),
    "weighted-no-replacement": ((2, 2), 2, 1),
    "grouped": ((2, 2), 11, 1),
    "grouped-short": ((2, 1), 4, 1),
    "stateful": ((2, 1), 17, 1),
    "stateful-batches": ((2, 1), 5, 1),
    "iterator-state": ((2, 1), 14, 1),  # torchdata's convention: the state on iter(sampler)
    "fast-forward": ((2, 1), 5, 1),
    "fast-forward-batches": ((2, 1), 16, 1),
    "dataset-state": ((1, 1), 17, 1),  # one copy of the dataset makes the batches: exact
}


def _kill_after(case: str, workers: int, world: int, step: int, out: Path) -> dict:
    """Run the child until it has saved the state of `step` (it then waits), SIGKILL it with
    its workers busy ahead, and return the state it saved last."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.sampler_train", case, "--workers", str(workers),
         "--world", str(world), "--epochs", str(EPOCHS), "--out", str(out), "--pause-at", str(step)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("step ") and int(line.split()[1]) == step:
                break
            assert time.monotonic() < deadline, "the child is too slow"
        else:
            pytest.fail(f"the child ended before step {step}: {child.wait()} {child.stderr.read()}")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    return json.loads((out / "state.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_and_resume_gives_the_uninterrupted_batches(case, tmp_path):
    (workers, world), kill_at, resumed_workers = CASES[case]
    assert world == 1 or case in WORLD_CHANGE
    (tmp_path / "reference").mkdir()
    reference = run(case, workers=0, world=1, epochs=EPOCHS, out=str(tmp_path / "reference"), resume=False)
    killed = tmp_path / "killed"
    killed.mkdir()
    saved = _kill_after(case, workers, world, kill_at, killed)
    count = saved["count"]
    assert count == kill_at < len(reference), f"killed at step {count} of {len(reference)}"
    lines = (killed / "records.jsonl").read_text().splitlines()[:count]
    before = [json.loads(line)["samples"] for line in lines]
    shutil.copy(killed / "state.json", killed / "resume.json")
    after = run(case, workers=resumed_workers, world=1, epochs=EPOCHS, out=str(killed), resume=True)
    got = before + after
    assert len(got) == len(reference), f"{len(got)} steps, the uninterrupted run has {len(reference)}"
    for n, (a, b) in enumerate(zip(got, reference)):
        assert a == b, f"step {n} (resumed at {count}): {a[:3]}... vs {b[:3]}..."
