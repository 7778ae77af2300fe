"""A run's lifecycle around the Loader (invariants I10, I11): the epoch loop resumes exactly or
raises, `close()` is bounded and idempotent, a script that never closes its loader exits within
seconds, and no process the library started outlives a SIGKILLed trainer (also under torchrun).

The SIGKILL tests walk the trainer's process tree (tests/proctree.py) before the kill and then
poll, with a deadline, until every process of it is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from shardloader import Dataset, Loader
from shardloader.errors import StateError, WorkerError
from shardloader.ingest.writer import write_shards
from tests.integration_runs import readline
from tests.proctree import Proc, descendants, kill_group, wait_gone
from tests.resume import assert_exact_epoch_loop_resume, epoch_loop, take
from tests.sample_transforms import make_samples as _samples
from tests.sample_transforms import noisy_crop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 4
STEPS = 13  # batches per epoch: 100 samples, batch 8, tail "pad"
ORPHAN_DEADLINE = 10.0  # seconds for every descendant of a killed trainer to be gone


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lifecycle-ds")
    write_shards(_samples(100), str(out), shard_samples=23)
    return str(out)


def make(dataset_dir, **kw):
    args = dict(batch_size=8, seed=3, shuffle=True, tail="pad", transform=noisy_crop, partitions=2, window=2)
    args.update(kw)
    return Loader(Dataset(dataset_dir), **args)


# -- the epoch contract: the resume matrix -------------------------------------------------------

MID_EPOCH_1 = STEPS + 5  # killed in the middle of epoch 1
END_OF_EPOCH_1 = 2 * STEPS  # killed right after epoch 1's last batch
END_OF_EPOCH_0 = STEPS


@pytest.fixture(scope="module")
def reference(dataset_dir):
    loader = make(dataset_dir)
    batches, _ = epoch_loop(loader, 0, EPOCHS)
    loader.close()
    assert len(batches) == EPOCHS * STEPS
    return batches


@pytest.mark.parametrize(
    "stop_after,start,outcome",
    [
        (MID_EPOCH_1, "saved", "exact"),
        (MID_EPOCH_1, "zero", "replay"),
        (MID_EPOCH_1, "saved+1", "skip"),
        (MID_EPOCH_1, "loader.epoch", "exact"),
        (END_OF_EPOCH_1, "saved", "exact"),
        (END_OF_EPOCH_1, "zero", "replay"),
        (END_OF_EPOCH_1, "saved+1", "exact"),
        (END_OF_EPOCH_1, "loader.epoch", "exact"),
        (END_OF_EPOCH_0, "zero", "exact"),  # the saved epoch is 0: same as "saved"
        (END_OF_EPOCH_0, "saved+1", "exact"),
        (5, "zero", "exact"),
        (5, "saved+1", "skip"),
    ],
    ids=lambda v: str(v),
)
def test_resume_matrix_of_the_epoch_loop(dataset_dir, reference, stop_after, start, outcome):
    """Every way to restart the loop equals the uninterrupted run or raises the documented
    StateError — never a different sequence (issue 10, items 3 and 4)."""
    starts = {"saved": lambda saved, _l: saved, "zero": lambda _s, _l: 0,
              "saved+1": lambda saved, _l: saved + 1, "loader.epoch": lambda _s, loader: loader.epoch}

    def run():
        assert_exact_epoch_loop_resume(lambda: make(dataset_dir), EPOCHS, stop_after, starts[start],
                                       reference=reference)

    if outcome == "exact":
        run()
    else:
        word = {"replay": "replay", "skip": "skip"}[outcome]
        with pytest.raises(StateError, match=rf"(?s){word}.*range\(loader\.epoch, epochs\).*force=True"):
            run()


def test_resume_matrix_with_process_workers(dataset_dir, reference):
    for stop_after in (MID_EPOCH_1, END_OF_EPOCH_1):
        assert_exact_epoch_loop_resume(lambda: make(dataset_dir, num_workers=2), EPOCHS, stop_after,
                                       lambda saved, _l: saved, reference=reference)


def test_loader_epoch_advances_when_the_iteration_ends(dataset_dir):
    """loader.epoch is the cursor's epoch: still e after epoch e's last batch was handed out,
    e + 1 once the loop over it ended (StopIteration). A state saved on the last batch is
    epoch e at its end, and a loader restored from it is there too."""
    loader = make(dataset_dir)
    assert loader.epoch == 0
    take(loader, STEPS)  # breaks right after the last batch of epoch 0
    assert loader.epoch == 0 and loader.state_dict()["epoch"] == 0
    state = loader.state_dict()
    fresh = make(dataset_dir)
    fresh.load_state_dict(state)
    assert fresh.epoch == 0 and fresh.step == STEPS
    assert list(fresh) == [] and fresh.epoch == 1  # epoch 0's loop is empty, then it has ended
    assert len(list(loader)) == STEPS and loader.epoch == 1  # a full pass ends the epoch


def test_an_epochs_end_state_resumes_into_that_epoch(dataset_dir):
    """Saved on epoch e's last batch and restored: epoch e's loop yields nothing (the user's
    epoch-end work runs, as in the uninterrupted run), then epoch e + 1 runs from its start;
    set_epoch(e + 1) straight away is allowed too and gives the same batches."""
    loader = make(dataset_dir)
    take(loader, STEPS)
    state = loader.state_dict()
    expected = [loader.step_samples(1, s).tolist() for s in range(STEPS)]
    for skip_empty_epoch in (False, True):
        fresh = make(dataset_dir)
        fresh.load_state_dict(state)
        ran_epoch_end = []
        for epoch in range(1 if skip_empty_epoch else 0, 2):
            fresh.set_epoch(epoch)
            got = [b["__index__"].tolist() for b in fresh]
            ran_epoch_end.append(epoch)
        assert got == expected
        assert ran_epoch_end == ([1] if skip_empty_epoch else [0, 1])


def test_a_break_then_iterating_again_restarts_the_epoch(dataset_dir):
    """As with DataLoader: a new iter() starts the epoch from its beginning, whether the last
    loop broke off mid-epoch or right after the last batch (before the loop ended)."""
    loader = make(dataset_dir)
    first = [loader.step_samples(0, s).tolist() for s in range(STEPS)]
    take(loader, 3)
    assert [b["__index__"].tolist() for b in loader] == first
    take(loader, STEPS)  # epoch 1, broken off after its last batch
    assert loader.epoch == 1
    assert [b["__index__"].tolist() for b in loader] == [loader.step_samples(1, s).tolist()
                                                         for s in range(STEPS)]


def test_force_moves_anyway(dataset_dir):
    loader = make(dataset_dir)
    take(loader, STEPS + 2)
    with pytest.raises(StateError, match="replay"):
        loader.set_epoch(0)
    loader.set_epoch(0, force=True)
    assert next(iter(loader))["__index__"].tolist() == loader.step_samples(0, 0).tolist()


def test_fresh_run_may_leave_an_epoch_early(dataset_dir):
    """As with DataLoader: break out of an epoch and set the next one (not a restored loader)."""
    loader = make(dataset_dir)
    seen = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            seen.append(batch["__index__"].tolist())
            if i == 2:
                break
    assert seen == [loader.step_samples(e, s).tolist() for e in range(2) for s in range(3)]


# -- close -------------------------------------------------------------------------------------

_RELEASE = threading.Event()
_ENTERED = threading.Event()


def _stuck(sample, generator=None):
    """A transform that does not return (a read hung on the network, say) until released."""
    _ENTERED.set()
    _RELEASE.wait(600)
    return sample


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_close_is_bounded_and_idempotent_with_a_stuck_worker(dataset_dir, worker_type):
    _RELEASE.clear()
    _ENTERED.clear()
    loader = make(dataset_dir, num_workers=2, worker_type=worker_type, transform=_stuck, timeout=0.5)
    try:
        pool = loader._workers.get()  # started now (iterators start theirs at the first next())
        pids = list(pool.pids()) if worker_type == "process" else []
        iterator = iter(loader)
        with pytest.raises(WorkerError, match="timeout"):
            next(iterator)
        started = time.monotonic()
        loader.close(timeout=1.0)
        loader.close(timeout=1.0)
        assert time.monotonic() - started < 5.0
        for pid in pids:
            assert _dead(pid), f"worker {pid} survived close()"
    finally:
        _RELEASE.set()  # let a stuck thread end (threads cannot be killed)


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_context_manager_closes(dataset_dir):
    with make(dataset_dir, num_workers=2) as loader:
        take(loader, 2)
        pids = loader._pool.pids()
    assert loader._pool is None
    assert all(_dead(p) for p in pids)


# -- scripts that end without close() -----------------------------------------------------------

EXIT_SCRIPT = """
import sys, time
from shardloader import Dataset, Loader
telemetry = None
if sys.argv[3] != "-":
    from shardloader.telemetry import MLflowLogger
    telemetry = MLflowLogger(tracking_uri=sys.argv[3], experiment="lifecycle-exit")
loader = Loader(Dataset(sys.argv[1]), batch_size=8, num_workers=2, worker_type=sys.argv[2],
                telemetry=telemetry)
for i, batch in enumerate(loader):
    if i == 2:
        break
print("LOOP DONE", flush=True)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
            "OMP_NUM_THREADS": "1"}


def _assert_exits_within_seconds(script_text: str, args: list[str], ready: str,
                                 tmp_path: Path) -> None:
    """Run `script_text`; once it prints `ready`, it must exit (status 0) within seconds and
    leave no process behind (I11)."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    errors = tmp_path / "stderr.txt"  # a file: a leftover process holding a pipe would hang reads
    with open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(script), *args],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(),
                                start_new_session=True)
    try:
        line = readline(proc, 120)
        assert line.strip() == ready, line + errors.read_text()
        tree = descendants(proc.pid)
        ready_at = time.monotonic()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script hung at exit for 30 s; its processes: "
                        f"{[p.describe() for p in descendants(proc.pid)]}")
        exit_seconds = time.monotonic() - ready_at
        assert proc.returncode == 0, errors.read_text()[-3000:]
        assert exit_seconds < 15.0, f"exit took {exit_seconds:.1f} s"  # a hang is forever
        left = wait_gone(tree, ORPHAN_DEADLINE)
        assert not left, [p.describe() for p in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("telemetry", [False, True], ids=["no-telemetry", "mlflow"])
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_module_level_loader_and_break_exits_within_seconds(dataset_dir, tmp_path, mlflow_local_store,
                                                           worker_type, telemetry):
    _assert_exits_within_seconds(EXIT_SCRIPT, [dataset_dir, worker_type,
                                               mlflow_local_store if telemetry else "-"],
                                 "LOOP DONE", tmp_path)


DROP_SCRIPT = """
import sys
from shardloader import Dataset, Loader

def train():
    loader = Loader(Dataset(sys.argv[1]), batch_size=8, num_workers=2, worker_type=sys.argv[2])
    for i, batch in enumerate(loader):
        if i == 2:
            return  # the loader is dropped here, never closed, with batches in flight

train()
print("RETURNED", flush=True)
"""


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_loader_dropped_without_close_lets_the_script_exit_cleanly(dataset_dir, tmp_path, worker_type):
    """A loader garbage-collected without close() just before the script ends: the exit is
    clean every time. Its pool's threads free its batches' tensors; when that fell after the
    interpreter began finalising, the process aborted (SIGABRT) in about 1 run of 5."""
    for run in range(6):
        folder = tmp_path / f"run{run}"
        folder.mkdir()
        _assert_exits_within_seconds(DROP_SCRIPT, [dataset_dir, worker_type], "RETURNED", folder)


STUCK_SCRIPT = """
import sys, threading
from shardloader import Dataset, Loader
from shardloader.errors import WorkerError

def hang(sample):  # a batch stuck for good: a read from a server that never answers, say
    threading.Event().wait()

loader = Loader(Dataset(sys.argv[1]), batch_size=8, num_workers=2, worker_type=sys.argv[2],
                transform=hang, timeout=1.0)
try:
    next(iter(loader))
except WorkerError:
    print("GAVE UP", flush=True)
"""


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_exit_without_close_while_a_worker_is_stuck(dataset_dir, tmp_path, worker_type):
    """Interpreter exit is bounded even when a worker never finishes its batch (I11)."""
    _assert_exits_within_seconds(STUCK_SCRIPT, [dataset_dir, worker_type], "GAVE UP", tmp_path)


# -- SIGKILL: no process outlives the trainer ----------------------------------------------------

TRAINER = """
import os, sys, threading
import torch
from shardloader import Dataset, Loader
from shardloader.checkpoint import Checkpointer
dist = None
if "RANK" in os.environ:
    import torch.distributed as dist
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist else 0
data, ckpt_dir, tracking = sys.argv[1], sys.argv[2], sys.argv[3]
telemetry = None
if tracking != "-" and rank == 0:
    from shardloader.telemetry import MLflowLogger
    telemetry = MLflowLogger(tracking_uri=tracking, experiment="lifecycle-kill")
loader = Loader(Dataset(data), batch_size=4, num_workers=2, telemetry=telemetry)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB
ckpt = Checkpointer(ckpt_dir, keep=2)
for step, batch in enumerate(loader, 1):
    if step == 3:
        ckpt.save(step, model=model, loader=loader)  # returns while the write goes on
        print(f"SAVING {rank} {os.getpid()}", flush=True)
        threading.Event().wait()  # until killed
"""


def _read_until(proc: subprocess.Popen, prefix: str, count: int, timeout: float) -> list[str]:
    """Messages starting with `prefix` from proc's stdout, `count` of them, within `timeout`.

    Several processes (torchrun's ranks) share one pipe, so two messages can arrive on one
    line; each occurrence of `prefix` starts a message."""
    found: list[str] = []
    deadline = time.monotonic() + timeout
    while len(found) < count:
        line = readline(proc, max(0.0, deadline - time.monotonic()))
        if not line:
            raise AssertionError(f"no {count} {prefix!r} lines within {timeout} s (rc={proc.poll()}): {found}")
        found.extend(prefix + rest.rstrip() for rest in line.split(prefix)[1:])
    return found


@pytest.mark.parametrize("telemetry", [False, True], ids=["loader-checkpoint", "loader-checkpoint-mlflow"])
def test_sigkilled_trainer_leaves_no_process(dataset_dir, tmp_path, mlflow_local_store, telemetry):
    """A trainer with 2 process workers and a Checkpointer mid-save (plus MLflowLogger) dies by
    SIGKILL: every process below it is gone within seconds."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), dataset_dir, str(tmp_path / "ckpt"),
                             mlflow_local_store if telemetry else "-"],
                            stdout=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    tree: list[Proc] = []
    try:
        _read_until(proc, "SAVING", 1, 120)
        tree = descendants(proc.pid)
        assert len(tree) >= 2, [p.describe() for p in tree]  # the two loader workers at least
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = wait_gone(tree, ORPHAN_DEADLINE)
        assert not left, f"alive {ORPHAN_DEADLINE} s after the trainer's SIGKILL: " + "; ".join(
            p.describe() for p in left)
    finally:
        kill_group(proc, tree)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigkilled_ranks_under_torchrun_leave_no_process(dataset_dir, tmp_path, mlflow_local_store):
    """Two ranks (gloo) with loader workers, a Checkpointer mid-save and MLflowLogger on rank 0:
    SIGKILL both training processes; every process below them is gone within seconds and
    torchrun ends."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(script),
           dataset_dir, str(tmp_path / "ckpt"), mlflow_local_store]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    tree: list[Proc] = []
    try:
        lines = _read_until(proc, "SAVING", 2, 180)
        ranks = [int(line.split()[2]) for line in lines]
        tree = descendants(proc.pid)
        below_ranks = [p for p in tree if p.pid not in ranks]
        assert len(below_ranks) >= 4, [p.describe() for p in tree]  # 2 workers per rank
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        left = wait_gone(tree, ORPHAN_DEADLINE)
        assert not left, f"alive {ORPHAN_DEADLINE} s after SIGKILL of the ranks: " + "; ".join(
            p.describe() for p in left)
        proc.wait(timeout=60)  # torchrun notices its workers died and ends
    finally:
        kill_group(proc, tree)


def test_descendants_sees_a_process_tree():
    """The tree walk the tests above rely on finds a grandchild, and wait_gone sees it end."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        child.wait()
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        tree = descendants(proc.pid)
        assert grandchild in [p.pid for p in tree]
        os.kill(grandchild, signal.SIGKILL)
        assert wait_gone([p for p in tree if p.pid == grandchild], 10) == []
    finally:
        proc.kill()
        proc.wait()
