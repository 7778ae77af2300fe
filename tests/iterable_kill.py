"""Run tests/iterable_train.py to its end, or SIGKILL it mid-epoch and run it again: the step
files it leaves (each batch's bytes and the loader's state after it) are what the
kill-and-resume tests compare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.proctree import descendants, wait_gone

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
       "HF_DATASETS_OFFLINE": "1"}


def _command(out: Path, dataset: str, num_workers: int, epochs: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.iterable_train", str(out), dataset, str(num_workers),
            str(epochs), *extra]


def run_to_end(out: Path, dataset: str, num_workers: int, epochs: int) -> None:
    out.mkdir(exist_ok=True)
    proc = subprocess.run(_command(out, dataset, num_workers, epochs), cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "done"


def run_and_kill(out: Path, dataset: str, num_workers: int, epochs: int, kill_after: int) -> None:
    """Start the run and SIGKILL its training process where it waits after step `kill_after`
    (mid-epoch, its workers running ahead); its workers die with it (checked)."""
    out.mkdir(exist_ok=True)
    proc = subprocess.Popen(_command(out, dataset, num_workers, epochs, str(kill_after)), cwd=ROOT,
                            env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line.strip())
        if line.strip() == f"step {kill_after}":
            tree = descendants(proc.pid)  # its worker processes, mid-epoch
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert f"step {kill_after}" in seen, f"the run ended before step {kill_after}: {seen[-5:]}"
    assert proc.returncode == -signal.SIGKILL
    assert len(tree) >= num_workers, f"expected {num_workers} worker processes: {tree}"
    assert wait_gone(tree, timeout=30) == [], "worker processes outlived the killed training process"


def steps(out: Path) -> list[dict]:
    """The step files, in order; they must be numbered 1..N without a gap."""
    found = [json.loads(p.read_text()) for p in sorted(out.glob("step-*.json"))]
    assert [s["step"] for s in found] == list(range(1, len(found) + 1))
    return found
