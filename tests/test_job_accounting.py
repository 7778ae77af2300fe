"""A job's account, from real runs of the README's loop (`tests/job_train.py`): SIGKILLed
between saves and in the middle of a save, resumed to its end, and accounted by
`shardloader report --job` (I15).

The expected figures come from what the runs printed (each step, as it finished) and from
the checkpoints that exist, never from the records being tested.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from shardloader.telemetry.job.account import account
from shardloader.telemetry.job.read import read_job_dir
from tests.integration_runs import env, survivors
from tests.job_train import write_data

BATCH, SAMPLES, SAVE_EVERY, EPOCHS = 32, 640, 4, 2
STEPS_PER_EPOCH = SAMPLES // BATCH
RUN_TIMEOUT = 240


def train(root: str, data: str, tmp_path, *args: str, marker: str | None = None) -> tuple[int, list[int]]:
    """Run the loop once; (its exit status, the steps it printed as done)."""
    marker = marker or uuid.uuid4().hex
    with open(tmp_path / f"stderr-{marker}", "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.job_train", root, data, "--batch", str(BATCH),
             "--save-every", str(SAVE_EVERY), "--epochs", str(EPOCHS), *args],
            cwd=tmp_path, env=env(marker), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err, text=True, timeout=RUN_TIMEOUT)
    assert survivors(marker) == [], "a process of the run outlived it"
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    if proc.returncode not in (0, -signal.SIGKILL):
        pytest.fail(open(tmp_path / f"stderr-{marker}").read()[-3000:])
    return proc.returncode, steps


@pytest.fixture
def data(tmp_path) -> str:
    path = str(tmp_path / "data")
    write_data(path, samples=SAMPLES)
    return path


def assert_closes(seconds: dict[str, float], wall: float) -> None:
    """The accounted seconds add up to the wall time (to 1%), and none is negative."""
    assert all(value >= 0 for value in seconds.values()), seconds
    assert sum(seconds.values()) == pytest.approx(wall, rel=0.01)


def test_a_job_killed_between_saves_and_during_a_save_is_accounted_exactly(tmp_path, data):
    root = str(tmp_path / "ckpt")
    rc1, steps1 = train(root, data, tmp_path, "--kill-at", "7")
    rc2, steps2 = train(root, data, tmp_path, "--kill-in-save", "12")
    rc3, steps3 = train(root, data, tmp_path)
    assert (rc1, rc2, rc3) == (-signal.SIGKILL, -signal.SIGKILL, 0)
    # Saves commit at multiples of 4: the first run's last is 4, the second's 8 (12 never did).
    assert steps1 == list(range(1, 8)) and steps2 == list(range(5, 15))
    assert steps3 == list(range(9, EPOCHS * STEPS_PER_EPOCH + 1))

    report = account(read_job_dir(root))
    attempts = report["attempts"]
    assert [a["ended"] for a in attempts] == ["killed", "killed", "finished"]
    assert [(a["first_step"], a["last_step"]) for a in attempts] == [
        (steps1[0], steps1[-1]), (steps2[0], steps2[-1]), (steps3[0], steps3[-1])]
    assert [a["restored_step"] for a in attempts] == [None, 4, 8]
    assert [a["last_committed_step"] for a in attempts] == [4, 8, EPOCHS * STEPS_PER_EPOCH]
    # Lost: the steps after each attempt's last committed checkpoint, exactly.
    assert [a["lost_steps"] for a in attempts] == [7 - 4, 14 - 8, 0]
    assert report["steps"] == {"trained": len(steps1) + len(steps2) + len(steps3),
                               "recomputed": 3 + 6, "lost": 3 + 6}
    assert report["samples"] == {
        "trained": (len(steps1) + len(steps2) + len(steps3)) * BATCH,
        "recomputed": (3 + 6) * BATCH, "trained_twice": 0, "never_trained": 0}
    assert report["lineage"]["complete"] is True
    assert report["seconds"]["lost_progress"] > 0
    assert_closes(report["seconds"], report["wall_seconds"])
    for attempt in attempts:
        assert_closes(attempt["seconds"], attempt["wall_seconds"])
    between = sum(b["start"] - a["end"] for a, b in zip(attempts, attempts[1:]))
    assert report["seconds"]["between_attempts"] == pytest.approx(between, abs=1e-6)
    assert report["goodput"] == pytest.approx(report["seconds"]["productive"] / report["wall_seconds"])
    assert report["bytes"]["checkpoint_written"] > 0

    # The CLI gives the same figures, and the text names what each attempt lost.
    cli = subprocess.run([sys.executable, "-m", "shardloader.cli.main", "report", "--job", root, "--json"],
                         env=env(), capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["samples"] == report["samples"]
    text = subprocess.run([sys.executable, "-m", "shardloader.cli.main", "report", "--job", root],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "killed" in text.stdout and "goodput" in text.stdout.lower()
    assert os.path.getsize(os.path.join(root, ".job", "report.png")) > 0


def test_data_wait_and_productive_time_match_what_the_script_measured(tmp_path, data):
    """A known data delay (every batch's read sleeps 20 ms) and compute time (every step
    sleeps 30 ms): the account's data wait and productive time are within 5% of the script's
    own clock of the same intervals."""
    root, measured = str(tmp_path / "ckpt"), tmp_path / "measured.json"
    rc, _ = train(root, data, tmp_path, "--delay", "0.02", "--compute", "0.03", "--measure", str(measured))
    assert rc == 0
    mine = json.loads(measured.read_text())
    report = account(read_job_dir(root))
    (attempt,) = report["attempts"]
    assert attempt["ended"] == "finished"
    assert mine["data_wait"] > 0.02 * (EPOCHS * STEPS_PER_EPOCH - 1)  # the delay was injected
    assert report["seconds"]["data_wait"] == pytest.approx(mine["data_wait"], rel=0.05)
    assert report["seconds"]["productive"] == pytest.approx(mine["compute"], rel=0.05)
    assert report["seconds"]["lost_progress"] == 0
    assert_closes(report["seconds"], report["wall_seconds"])


def test_a_failing_run_is_recorded_as_failed_with_its_error(tmp_path, data):
    """An uncaught exception ends the attempt as "failed", with the error."""
    root = str(tmp_path / "ckpt")
    script = tmp_path / "fails.py"
    script.write_text(
        "import sys\n"
        "from shardloader.checkpoint import Checkpointer\n"
        "ckpt = Checkpointer(sys.argv[1])\n"
        "raise RuntimeError('out of memory, say')\n")
    proc = subprocess.run([sys.executable, str(script), root], env=env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "out of memory, say" in proc.stderr
    (attempt,) = account(read_job_dir(root))["attempts"]
    assert attempt["ended"] == "failed"
    assert attempt["error"] == "RuntimeError: out of memory, say"


def test_another_job_name_is_refused_before_anything_is_written(tmp_path):
    from shardloader.checkpoint import Checkpointer
    from shardloader.errors import CheckpointError

    root = tmp_path / "ckpt"
    with Checkpointer(root, job="alpha") as ckpt:
        ckpt.save(1, x={"a": 1})
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    with pytest.raises(CheckpointError, match=r"belongs to job 'alpha'.*not 'beta'"):
        Checkpointer(root, job="beta")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == before
    with Checkpointer(root) as again:  # no name: the root's own job
        assert again.steps() == [1]


def test_a_job_on_an_s3_root_is_accounted_from_the_root(tmp_path, data, s3_server, s3_bucket):
    """The records of a remote root are written locally and copied to `<root>/.job/` in the
    background; `shardloader report --job s3://...` reads them from there."""
    root = f"s3://{s3_bucket}/ckpt"
    options = json.dumps(s3_server.storage_options())
    rc1, steps1 = train(root, data, tmp_path, "--kill-at", "7", "--storage-options-json", options)
    rc2, steps2 = train(root, data, tmp_path, "--storage-options-json", options)
    assert (rc1, rc2) == (-signal.SIGKILL, 0)
    report = account(read_job_dir(root, s3_server.storage_options()))
    # The killed attempt's records reached the root at its last copy (at its first heartbeat,
    # after each commit, every 10 s): known up to that copy, but there, and killed.
    assert [a["ended"] for a in report["attempts"]] == ["killed", "finished"]
    last = report["attempts"][-1]
    assert (last["first_step"], last["last_step"]) == (steps2[0], steps2[-1])
    assert report["samples"]["trained_twice"] == report["samples"]["never_trained"] == 0
    assert_closes(report["seconds"], report["wall_seconds"])


def test_a_with_block_that_raises_ends_its_attempt_as_failed(tmp_path):
    from shardloader.checkpoint import Checkpointer

    root = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="diverged"):
        with Checkpointer(root):
            raise RuntimeError("loss diverged")
    (attempt,) = account(read_job_dir(root))["attempts"]
    assert (attempt["ended"], attempt["error"]) == ("failed", "RuntimeError: loss diverged")
