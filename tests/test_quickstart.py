"""The README's quick start is the tested loop: its two code blocks run exactly as written
(in a fresh folder: local shards, checkpoints and the default MLflow store land there).

Also run as users run it: killed with SIGKILL mid-run and run again (it resumes from the newest
complete checkpoint with exactly the uninterrupted run's batches, same augmented bytes), and left
by `sys.exit` from inside the loop without any `close()` (it exits within seconds). After each,
no process it started is left: every process carrying the run's environment marker is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.proctree import with_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30  # 640 samples, batch 64: 10 steps per epoch, 3 epochs
MARK = "SHARDLOADER_QUICKSTART_RUN"

# Inserted between the README's blocks: records each step's samples and image bytes, and can
# kill or exit the script at a step. Reads the quick start's own module-level `step`.
RECORDER = '''
import hashlib as _hashlib, json as _json, signal as _signal, sys as _sys
_user_train_step = train_step


def train_step(model, opt, batch):
    this = step + 1
    with open(os.environ["QS_RECORD"], "a") as f:
        f.write(_json.dumps({"step": this, "indices": batch["__index__"].tolist(),
                             "image": _hashlib.sha256(batch["image"].numpy().tobytes()).hexdigest()}) + "\\n")
    if this == int(os.environ.get("QS_KILL_AT", "0")):
        os.kill(os.getpid(), _signal.SIGKILL)
    if this == int(os.environ.get("QS_EXIT_AT", "0")):
        _sys.exit(0)  # leaves the loop and the script: no close() of anything
    return _user_train_step(model, opt, batch)
'''


def readme_blocks() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("## Quick start"):]
    section = section[:re.search(r"\n##+ ", section[3:]).start() + 3]  # up to the next heading
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, f"expected the setup and the loop blocks in the quick start, found {len(blocks)}"
    return blocks


def run(folder, *, record: str, env: dict[str, str] | None = None, recorder: bool = True,
        timeout: float = 300) -> tuple[subprocess.CompletedProcess, str]:
    """Run the README's blocks as one script in `folder`. Output goes to files, not pipes: a
    process the script leaves behind would hold a pipe open and hang the wait for its end."""
    setup, loop = readme_blocks()
    script = folder / "quickstart.py"
    script.write_text(setup + (RECORDER if recorder else "") + loop)
    marker = uuid.uuid4().hex
    full_env = {**os.environ, **(env or {}), MARK: marker, "QS_RECORD": str(folder / record),
                "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), "OMP_NUM_THREADS": "1"}
    log = folder / f"{record}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script)], cwd=folder, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the quick start did not end within {timeout} s: {log.read_text()[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", log.read_text()), marker


def records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def assert_nothing_left(marker: str, what: str) -> None:
    deadline = time.monotonic() + 10.0
    while (left := with_env(MARK, marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in left:  # leave no orphan behind a failing test
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"{what}: processes left 10 s later: " + "; ".join(p.describe() for p in left)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quickstart-reference")
    proc, marker = run(folder, record="steps.jsonl")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_nothing_left(marker, "the uninterrupted run")
    steps = records(folder / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return steps


def test_quick_start_runs_as_written(tmp_path):
    proc, marker = run(tmp_path, record="unused.jsonl", recorder=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert os.listdir(tmp_path / "checkpoints")
    assert os.path.exists(tmp_path / "mlflow.db")  # MLflow's default store, in the run's folder
    assert_nothing_left(marker, "the quick start")


def test_killed_and_run_again_continues_exactly(tmp_path, reference):
    killed, marker = run(tmp_path, record="first.jsonl", env={"QS_KILL_AT": "14"})
    assert killed.returncode == -9, killed.stderr[-4000:]
    assert_nothing_left(marker, "the run killed by SIGKILL")
    first = records(tmp_path / "first.jsonl")
    assert first == reference[:14]
    again, marker = run(tmp_path, record="second.jsonl")
    assert again.returncode == 0, again.stderr[-4000:]
    assert_nothing_left(marker, "the resumed run")
    second = records(tmp_path / "second.jsonl")
    resumed_at = second[0]["step"] - 1
    assert resumed_at in (5, 10), f"resumed at step {resumed_at}; checkpoints were saved at 5 and 10"
    assert second == reference[resumed_at:], "the resumed run's batches differ from the uninterrupted run's"


def test_exit_from_inside_the_loop_without_close(tmp_path, reference):
    started = time.monotonic()
    proc, marker = run(tmp_path, record="steps.jsonl", env={"QS_EXIT_AT": "7"}, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert records(tmp_path / "steps.jsonl") == reference[:7]
    assert_nothing_left(marker, "the script that exited without close()")
    assert took < 90, f"the script took {took:.0f} s"
