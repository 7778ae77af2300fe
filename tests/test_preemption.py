"""Preemption notices (issue 39): real signals to real training processes
(`tests/preempt_train.py`, the README's loop with `Checkpointer(..., preemption=...)`).

One job is preempted at a dozen moments in turn, each run resuming from the checkpoint the run
before it saved: in start-up, in a restore, in the first batch, mid-step, on a save's step,
while a save stages, while a save is in flight, between epochs, by a SIGTERM to the whole
process group with loader workers, by SIGUSR1 (SLURM's `--signal`), with a second SIGTERM in
the middle of the preemption's save, and with a deadline too short for it. Whenever the grace
suffices the run exits 75 having lost no step; the deadline too short exits 76 with the
previous checkpoint the newest. The job's steps and final weights equal an uninterrupted run's
bit for bit, and its account names each ending. The steps lost and the seconds from signal to
exit of each moment are printed (`-s`) and written to $PREEMPTION_RESULTS when set.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from shardloader.checkpoint import EXIT_PREEMPTED, EXIT_PREEMPTED_LOST
from shardloader.checkpoint.catalog import list_complete
from shardloader.checkpoint.storage import open_store
from shardloader.telemetry.job.account import account
from shardloader.telemetry.job.read import read_job_dir
from shardloader.telemetry.job.render import render_job_text
from tests.job_train import write_data
from tests.preemption_runs import Run, fifo, release, start, torchrun_cmd, train_cmd

SAMPLES, BATCH, SAVE_EVERY, EPOCHS = 640, 32, 4, 3
STEPS = EPOCHS * SAMPLES // BATCH  # 60


def newest_step(root: str) -> int | None:
    complete = list_complete(open_store(root))
    return complete[-1].step if complete else None


def commit_seconds(stderr: str) -> float | None:
    """The seconds from the notice to the commit, as the run's ending said (None: not saved)."""
    found = re.findall(r"saved step \d+ in ([0-9.]+) s", open(stderr).read())
    return max(map(float, found)) if found else None


def report(results: list[dict], name: str) -> None:
    print(f"\n{'moment':<42} {'exit':>4} {'saved':>5} {'lost':>4} {'to commit':>9} {'to exit':>8}")
    for r in results:
        commit = "-" if r["commit_s"] is None else f"{r['commit_s']:.2f} s"
        print(f"{r['moment']:<42} {r['rc']:>4} {r['saved']!s:>5} {r['lost']:>4} {commit:>9} "
              f"{r['seconds']:>6.2f} s")
    out = os.environ.get("PREEMPTION_RESULTS")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1)


@pytest.fixture
def data(tmp_path) -> str:
    path = str(tmp_path / "data")
    write_data(path, samples=SAMPLES)
    return path


@pytest.mark.timeout(900)  # 14 launches of a torch script: about 1 min on an idle 2-core machine
def test_a_notice_at_any_moment_saves_the_step_and_the_job_continues_bit_for_bit(tmp_path, data):
    ref = start(train_cmd(str(tmp_path / "ref"), data, "--epochs", str(EPOCHS)), str(tmp_path))
    assert ref.finish()[0] == 0
    reference, weights = ref.steps(), ref.lines[-2]
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))

    root, cwd = str(tmp_path / "ckpt"), str(tmp_path)
    kept: list[tuple[int, str]] = []  # the steps that are in the job's weights, in order
    results: list[dict] = []

    def preempt(moment: str, *args: str, hold: str | None = None, after=None,
                sig: int = signal.SIGTERM, group: bool = False, rc: int = EXIT_PREEMPTED) -> Run:
        """One run: parked at `hold` (or once ready), signalled, let go; `after` does more."""
        before = newest_step(root) or 0
        print(f"{moment}: from step {before}", flush=True)
        holds = {} if hold is None else {hold: fifo(cwd)}
        extra = [a for what, path in holds.items() for a in ("--hold", f"{what}={path}")]
        run = start(train_cmd(root, data, "--epochs", str(EPOCHS), *args, *extra), cwd)
        run.expect("ready")
        if hold is not None:
            run.expect(f"held {hold}")
        run.signal(run.pid_of(), sig, group=group)
        if hold is not None:
            release(holds[hold], run)
        if after is not None:
            after(run)
        code, took = run.finish()
        steps = run.steps()
        saved = newest_step(root) or 0
        assert code == rc, (moment, code, open(run.stderr).read()[-2000:])
        assert [s for s, _ in steps] == list(range(before + 1, (steps or [(before, "")])[-1][0] + 1))
        last = steps[-1][0] if steps else before
        kept.extend(s for s in steps if s[0] <= saved)
        results.append({"moment": moment, "rc": code, "saved": saved, "lost": last - saved,
                        "commit_s": commit_seconds(run.stderr), "seconds": round(took, 3)})
        return run

    # start-up: the Checkpointer is made, the loader has not started: step 1 is saved
    preempt("start-up (before the first batch)")
    preempt("in a restore (ckpt.load)", hold="restore")
    preempt("in the first batch", hold="first-batch")
    preempt("mid-step", hold=f"step:{newest_step(root) + 2}")
    on_save = (newest_step(root) // SAVE_EVERY + 1) * SAVE_EVERY
    preempt("mid-step of a save's step", hold=f"step:{on_save}")
    due = (newest_step(root) // SAVE_EVERY + 1) * SAVE_EVERY
    preempt("mid-save: staging (training thread)", hold=f"stage:{due}")
    due = (newest_step(root) // SAVE_EVERY + 1) * SAVE_EVERY
    preempt("mid-save: upload in flight (async)", hold=f"upload:{due}")
    preempt("between epochs", hold="epoch-end")  # the first epoch's end this run reaches
    preempt("SIGTERM to the process group, 2 workers", "--workers", "2",
            hold=f"step:{newest_step(root) + 2}", group=True)
    preempt("SIGUSR1 (SLURM --signal)", "--notice-signals", "SIGTERM,SIGUSR1",
            hold=f"step:{newest_step(root) + 2}", sig=signal.SIGUSR1)

    second = newest_step(root) + 2
    upload = fifo(cwd)

    def second_sigterm(run: Run) -> None:
        run.expect(f"held upload:{second}")
        run.signal(run.pid_of(), signal.SIGTERM)  # a second notice, mid-save
        release(upload, run)

    preempt("second SIGTERM mid-save", "--hold", f"upload:{second}={upload}",
            hold=f"step:{second}", after=second_sigterm)
    assert newest_step(root) == second

    lost_at = newest_step(root)
    never = fifo(cwd)  # never opened: the save of the preempted step stays in its upload
    too_short = preempt("deadline too short (2 s, upload stuck)", "--deadline", "2",
                        "--save-every", "1000", "--hold", f"upload:{lost_at + 2}={never}",
                        hold=f"step:{lost_at + 2}", rc=EXIT_PREEMPTED_LOST)
    assert newest_step(root) == lost_at  # the previous checkpoint is the newest
    assert "preempted, not saved" in open(too_short.stderr).read()

    final = start(train_cmd(root, data, "--epochs", str(EPOCHS)), cwd)
    code, _ = final.finish()
    assert code == 0, open(final.stderr).read()[-2000:]
    assert f"resumed {lost_at}" in final.lines
    kept.extend(final.steps())
    report(results, "single-process")

    assert kept == reference  # every step once, each batch the uninterrupted run's
    assert final.lines[-2] == weights  # the weights too, bit for bit
    assert [r["lost"] for r in results] == [0] * (len(results) - 1) + [2]
    assert all(r["seconds"] < 25 for r in results)

    job = account(read_job_dir(root))
    endings = [a["ended"] for a in job["attempts"]]
    assert endings == ["preempted_saved"] * (len(results) - 1) + ["preempted_lost", "finished"]
    assert [a["lost_steps"] for a in job["attempts"]] == [r["lost"] for r in results] + [0]
    assert "SIGUSR1: saved step" in job["attempts"][9]["reason"]
    text = render_job_text(job)
    assert f"{len(results) - 1} preempted saved, 1 preempted lost" in text
    assert "preempted lost: SIGTERM: not saved" in text


@pytest.mark.timeout(600)
def test_under_torchrun_every_rank_saves_the_same_step(tmp_path, data):
    """2 ranks (gloo): SIGTERM to one rank, then to the torchrun agent; both ranks save the
    same step each time; then a rank SIGKILLed is named as its attempt's cause; the resumed
    job ends with the uninterrupted run's weights."""
    cwd, root = str(tmp_path), str(tmp_path / "ckpt")
    args = ("--epochs", "1")
    ref = start(torchrun_cmd(str(tmp_path / "ref"), data, *args), cwd)
    assert ref.finish()[0] == 0, open(ref.stderr).read()[-3000:]
    weights = {line for line in ref.lines if " weights " in line}
    results = []

    for moment, rank, at, target in (("SIGTERM to rank 1", 1, 3, "rank"),
                                     ("SIGTERM to the torchrun agent", 0, 6, "agent")):
        hold = fifo(cwd)
        run = start(torchrun_cmd(root, data, *args, "--hold", f"step:{at}={hold}",
                                 "--hold-rank", str(rank)), cwd)
        run.expect(f"rank {rank} held step:{at}")
        run.signal(run.pid_of(rank) if target == "rank" else run.proc.pid)
        release(hold, run)
        code, took = run.finish()
        assert code != 0, moment
        # The agent passes the signal on when its monitor loop wakes: the ranks may see it a
        # step later than the one parked. Either way every rank's last step is the one saved.
        saved = newest_step(root)
        last = [run.steps(r)[-1][0] for r in (0, 1)]
        assert last == [saved, saved] and saved >= at, (last, saved, at)
        stderr = open(run.stderr).read()
        assert stderr.count(f"saved step {saved} in") == 2, stderr[-3000:]  # each rank's ending
        results.append({"moment": f"torchrun, {moment}", "rc": code, "saved": saved, "lost": 0,
                        "commit_s": commit_seconds(run.stderr), "seconds": round(took, 3)})

    # The case: rank 1 SIGKILLed; rank 0 then fails in a collective. The account names
    # the killed rank as the cause, not rank 0's gloo error.
    hold = fifo(cwd)
    restored = newest_step(root)
    kill_at = restored + 2
    run = start(torchrun_cmd(root, data, *args, "--hold", f"step:{kill_at}={hold}",
                             "--hold-rank", "1"), cwd)
    run.expect(f"rank 1 held step:{kill_at}")
    run.signal(run.pid_of(1), signal.SIGKILL)
    assert run.finish()[0] != 0
    killed = account(read_job_dir(root))["attempts"][-1]
    assert (killed["ended"], killed["restored_step"]) == ("killed", restored)
    # Rank 0 finished step kill_at (rank 1 was parked after its backward) and waited in the
    # next check: the steps after the last commit are lost.
    assert run.steps(0)[-1][0] == kill_at
    assert killed["lost_steps"] == kill_at - restored
    assert killed["reason"].startswith("rank 1 killed: it ended without recording an ending")

    final = start(torchrun_cmd(root, data, *args), cwd)
    assert final.finish()[0] == 0, open(final.stderr).read()[-3000:]
    report(results, "torchrun")
    assert {line for line in final.lines if " weights " in line} == weights
    job = account(read_job_dir(root))
    assert [(a["ended"], a["lost_steps"], a["ranks"]) for a in job["attempts"]] == [
        ("preempted_saved", 0, 2), ("preempted_saved", 0, 2), ("killed", 2, 2), ("finished", 0, 2)]


def test_arguments_are_checked_first():
    from shardloader.checkpoint import Checkpointer, Preemption

    with pytest.raises(ValueError, match="'SIGNOPE' is not a signal"):
        Preemption(signals=("SIGNOPE",))
    with pytest.raises(ValueError, match="deadline"):
        Preemption(deadline=0)
    with pytest.raises(TypeError, match="preemption must be"):
        Checkpointer("unused", preemption="yes")
    assert Preemption(signals="USR1").signals == ("USR1",)


def test_in_process_the_save_after_a_notice_commits_and_exits_75(tmp_path):
    """The same path without a subprocess: a real SIGTERM to this process, then the check and
    the save; the handlers are put back afterwards."""
    import torch

    from shardloader.checkpoint import Checkpointer

    before = signal.getsignal(signal.SIGTERM)
    model = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), preemption=5)
    assert not ckpt.preempted()
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
    assert ckpt.preempted() and ckpt.preempted()
    with pytest.raises(SystemExit) as exit_:
        ckpt.save(3, model=model)
    assert exit_.value.code == EXIT_PREEMPTED
    assert newest_step(str(tmp_path / "ckpt")) == 3
    assert signal.getsignal(signal.SIGTERM) == before
    events = read_job_dir(str(tmp_path / "ckpt"))["attempts"][0]["ranks"][0]["events"]
    end = events[-1]
    assert (end["event"], end["how"], end["signal"], end["step"]) == ("end", "preempted_saved", "SIGTERM", 3)
    assert end["error"].startswith("SIGTERM: saved step 3 in ")
