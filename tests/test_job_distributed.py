"""A job under torchrun (2 ranks, gloo, CPU; I15): the README's loop (`tests/job_train.py`) with
one rank whose reads are slow (`--slow-rank`: only that rank's transform sleeps). The launch is
one attempt with both ranks; its totals are counted once (the ranks advance the same global
positions: not twice); its seconds close on the wall time; and the report names the slow rank
as the one that waited most, overall and in every epoch, in the account and in the text of
`shardloader report --job`.

The expected figures are the run's shape (samples, batch, epochs, world size) and the injected
delay, never the records being tested.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from shardloader.telemetry.job.account import account
from shardloader.telemetry.job.read import read_job_dir
from tests.fixtures.checkpoint import free_port
from tests.integration_runs import ROOT, env, survivors
from tests.job_train import write_data

WORLD, BATCH, SAMPLES, EPOCHS = 2, 32, 640, 2  # BATCH per rank: a global batch of 64
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)
SLOW_RANK, DELAY = 1, 0.1  # seconds each of the slow rank's batches sleeps in its reads
RUN_TIMEOUT = 300


def test_two_ranks_one_slow_are_one_attempt_and_the_report_names_the_slow_rank(tmp_path):
    data, root = str(tmp_path / "data"), str(tmp_path / "ckpt")
    write_data(data, samples=SAMPLES)
    marker = uuid.uuid4().hex
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
             "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
             "-m", "tests.job_train", root, data, "--batch", str(BATCH), "--epochs", str(EPOCHS),
             "--slow-rank", str(SLOW_RANK), "--delay", str(DELAY)],
            cwd=ROOT, env=env(marker), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err, text=True, timeout=RUN_TIMEOUT)
    assert survivors(marker) == [], "a process of the run outlived it"
    if proc.returncode != 0:
        pytest.fail(open(tmp_path / "stderr").read()[-4000:])
    assert proc.stdout.count("done") == WORLD  # each rank ran to its end

    report = account(read_job_dir(root))
    (attempt,) = report["attempts"]  # one launch: one attempt, both ranks in it
    assert attempt["ranks"] == WORLD and attempt["ended"] == "finished"
    steps = EPOCHS * STEPS_PER_EPOCH
    # Counted once: the global positions of the run and its steps, not once per rank.
    assert report["samples"]["trained"] == attempt["samples"]["trained"] == EPOCHS * SAMPLES
    assert report["steps"]["trained"] == steps and (attempt["first_step"], attempt["last_step"]) == (1, steps)
    assert report["samples"]["trained_twice"] == report["samples"]["never_trained"] == 0
    for seconds, wall in ((report["seconds"], report["wall_seconds"]),
                          (attempt["seconds"], attempt["wall_seconds"])):
        assert all(value >= 0 for value in seconds.values()), seconds
        assert sum(seconds.values()) == pytest.approx(wall, rel=0.01)

    wait = report["data_wait"]
    per_rank = {int(rank): s for rank, s in wait["per_rank"].items()}
    assert sorted(per_rank) == list(range(WORLD))
    # The slow rank slept DELAY per batch after its first (that one is startup), at the least.
    assert per_rank[SLOW_RANK] >= (steps - 1) * DELAY
    assert wait["max_rank"] == SLOW_RANK and wait["max"] == per_rank[SLOW_RANK]
    assert [e["epoch"] for e in wait["epochs"]] == list(range(EPOCHS))
    assert [e["max_rank"] for e in wait["epochs"]] == [SLOW_RANK] * EPOCHS, wait["epochs"]

    cli = subprocess.run(
        [sys.executable, "-m", "shardloader.cli.main", "report", "--job", root, "--plot",
         str(tmp_path / "job.png")],
        cwd=ROOT, env=env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr[-3000:]
    text = cli.stdout
    header = next(line for line in text.splitlines() if line.startswith("data wait by rank"))
    assert header.endswith(f"(rank {SLOW_RANK})"), header
    for epoch in range(EPOCHS):
        assert f"epoch {epoch:<4} rank {SLOW_RANK} waited most" in text, text
    if max(report["seconds"], key=lambda k: 0 if k == "productive" else report["seconds"][k]) == "data_wait":
        assert f"Rank {SLOW_RANK} waited most" in text, text  # the diagnosis, when data wait leads
    print(f"per-rank data wait {per_rank}; epochs {wait['epochs']}; wall {report['wall_seconds']:.2f} s; "
          f"seconds {report['seconds']}")


def test_ranks_end_with_a_killed_torchrun_agent_and_never_commit_after_it(tmp_path):
    """Issue 25 item 14: SIGKILL the torchrun agent (not the ranks) while a save is in
    flight. Its ranks and their loader workers end within seconds, and the save in flight never
    commits, even once it could go on (the FIFO it waits on is opened after the kill)."""
    import errno
    import os
    import signal

    from tests.integration_runs import ORPHAN_DEADLINE, readline
    from tests.proctree import descendants, wait_gone

    data, root, fifo = str(tmp_path / "data"), str(tmp_path / "ckpt"), str(tmp_path / "hold")
    write_data(data, samples=SAMPLES)
    os.mkfifo(fifo)
    marker = uuid.uuid4().hex
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--nnodes=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
         "-m", "tests.job_train", root, data, "--batch", str(BATCH), "--epochs", str(EPOCHS),
         "--workers", "1", "--hold-save", "8", "--hold-until", fifo],
        cwd=ROOT, env=env(marker), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        held = 0
        while held < WORLD:  # both ranks are inside the save of step 8
            line = readline(agent, RUN_TIMEOUT)
            assert line, "the run ended before its save of step 8 was held"
            held += line.strip() == "held 8"
        tree = descendants(agent.pid)  # the ranks and their loader workers
        assert len(tree) >= WORLD
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
        try:  # a rank still alive (reading the FIFO) would now go on and commit step 8
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:  # ENXIO: no reader left
            assert exc.errno == errno.ENXIO, exc
        assert wait_gone(tree, ORPHAN_DEADLINE) == [], "ranks outlived their torchrun agent"
    finally:
        left = survivors(marker)
    assert left == []
    committed = sorted(name for name in os.listdir(root)
                       if os.path.exists(os.path.join(root, name, "manifest.json")))
    assert committed and all(not name.startswith("step-0000000008") for name in committed), committed
