"""Worker start-up, whatever the training process did before (issue 25, items 7 and 15).

- Item 7: a training process that used OpenCV's thread pool (a resize of a large image) or
  torch's intra-op pool before it forks its workers: every worker starts, and the batches are
  those of a run that did not. Real scripts in subprocesses with hard timeouts (today's main
  hung in every worker, in `cv2.setNumThreads(1)`).
- A worker that does not start is a WorkerError naming the start-up step it is stuck in,
  within the start-up bound: a real cause, a transform that fetches its configuration from a
  server when it is unpickled in a "spawn" worker, and the server never answers.
- Item 15: a trainer whose Loader was made on a thread other than the main one, with both
  workers busy in C code that holds the GIL, is SIGKILLed: every worker is gone within 10 s.
"""

from __future__ import annotations

import pickle
import signal
import socket
import subprocess
import sys
import time

import pytest

from shardloader import Dataset, Loader, write_shards
from shardloader.errors import WorkerError
from shardloader.loader.workers import pool as pool_module
from shardloader.synthetic import make_image_samples
from tests.integration_runs import env, readline
from tests.proctree import Proc, descendants, kill_group, wait_gone
from tests.resume import assert_same_batches

RUN_TIMEOUT = 120  # seconds for one reproduction script, start to end (it takes a few)
ORPHAN_DEADLINE = 10.0  # seconds for a killed trainer's workers to be gone


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("startup-images")
    write_shards(make_image_samples(24, min_size=64, max_size=96), str(out), shard_samples=8)
    return str(out)


# -- item 7: thread pools used before the workers are forked -------------------------------------

BEFORE_FORK = """
import pickle, sys
import numpy as np
from shardloader import Dataset, Loader
from shardloader.transforms import DecodeCropFlip
from tests.resume import record

data, used, out = sys.argv[1], sys.argv[2], sys.argv[3]
report = {}
if used == "opencv":  # what visualisation code or an Albumentations pipeline does
    import cv2
    cv2.resize(np.zeros((2000, 2000, 3), np.uint8), (1000, 1000))  # runs OpenCV's thread pool
    report["threads"] = cv2.getNumThreads()
elif used == "torch":
    import torch
    torch.set_num_threads(4)
    a = torch.randn(1024, 1024)
    (a @ a).sum().item()  # runs torch's intra-op pool (OpenMP) with 4 threads
    report["threads"] = torch.get_num_threads()
loader = Loader(Dataset(data), batch_size=4, num_workers=2, seed=5, shuffle=True,
                transform=DecodeCropFlip(32))
report["batches"] = [record(batch) for batch in loader]
if used == "opencv":
    report["threads_after"] = cv2.getNumThreads()  # the training process's own setting
elif used == "torch":
    report["threads_after"] = torch.get_num_threads()
with open(out, "wb") as f:
    pickle.dump(report, f)
"""


def _run_before_fork(image_dir: str, tmp_path, used: str) -> dict:
    script = tmp_path / "before_fork.py"
    script.write_text(BEFORE_FORK)
    out = tmp_path / f"{used}.pickle"
    # OpenCV's pool threads first spin for a moment after a job, then sleep on a condition;
    # a script forks long after its last OpenCV call, when they sleep, and that is when a
    # forked child's cv2.setNumThreads(1) hangs. 0 makes them sleep at once (OpenCV's own
    # setting): the hang then reproduces every time instead of in about half the runs.
    run_env = env(OPENCV_THREAD_POOL_ACTIVE_WAIT_WORKER="0")
    try:
        proc = subprocess.run([sys.executable, str(script), image_dir, used, str(out)],
                              env=run_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT,
                              start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"with {used} used before the Loader, the run did not end within "
                             f"{RUN_TIMEOUT} s (workers stuck in start-up?): {e.output}") from None
    assert proc.returncode == 0, proc.stdout[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def untouched(image_dir, tmp_path_factory):
    """The batches of a run whose training process used no thread pool before forking."""
    return _run_before_fork(image_dir, tmp_path_factory.mktemp("untouched"), "nothing")["batches"]


@pytest.mark.parametrize("used", ["opencv", "torch"])
def test_workers_start_after_the_training_process_used_a_thread_pool(image_dir, tmp_path, untouched, used):
    report = _run_before_fork(image_dir, tmp_path, used)
    assert report["threads"] > 1, report["threads"]  # the pool really ran with threads
    assert len(untouched) == 6
    assert_same_batches(report["batches"], untouched, f"after {used} in the training process")
    assert report["threads_after"] == report["threads"]  # the training process's setting is kept


# -- a worker that does not start: a clear error, within the bound --------------------------------

class RemotelyConfigured:
    """A transform that fetches its configuration from a server when it is unpickled, as a
    worker started by "spawn" does first (a model-based augmentation loading its weights, say).
    The recv is bounded (120 s), far beyond the test's start-up bound."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address

    def __reduce__(self):
        return _fetch_configuration, (self.address,)

    def __call__(self, sample, generator=None):
        return sample


def _fetch_configuration(address: tuple[str, int]) -> RemotelyConfigured:
    with socket.create_connection(address, timeout=120) as conn:
        conn.recv(1)  # the server accepted (the kernel did) and never answers
    return RemotelyConfigured(address)


def test_a_worker_stuck_in_start_up_is_a_clear_error(image_dir, monkeypatch):
    monkeypatch.setattr(pool_module, "WORKER_START_SECONDS", 5.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # connections complete in the backlog; none is ever accepted
        loader = Loader(Dataset(image_dir), batch_size=4, num_workers=1,
                        multiprocessing_context="spawn",
                        transform=RemotelyConfigured(silent.getsockname()))
        try:
            began = time.monotonic()
            pids = loader._workers.get().pids()  # started now; the first next() waits for it
            assert len(pids) == 1
            with pytest.raises(WorkerError) as raised:
                next(iter(loader))
            took = time.monotonic() - began
        finally:
            loader.close(timeout=2.0)
    message = str(raised.value)
    assert "worker 0" in message and "did not start within 5.0 s" in message, message
    assert "unpickling its dataset, transform and collate_fn" in message, message
    assert took < 5.0 + 30.0, took  # the bound, plus this loaded machine's spawn of the worker
    for pid in pids:
        assert not _running(pid), f"worker {pid} survived close()"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# -- item 15: a Loader made on a thread, workers busy in GIL-holding C code, trainer SIGKILLed -----

ON_A_THREAD = """
import os, sys, threading
from shardloader import Dataset, Loader

def busy(sample, generator=None):
    os.write(1, f"BUSY {os.getpid()}\\n".encode())  # one write: both workers share the pipe
    pow(3, (1 << 400_000) - 1, 7 ** 4000)  # C code holding the GIL: about two minutes here
    return sample

def train():  # trainers that run the training function in a thread of their own
    loader = Loader(Dataset(sys.argv[1]), batch_size=1, num_workers=2, transform=busy)
    for _ in loader:
        pass

thread = threading.Thread(target=train)
thread.start()
thread.join()
"""


def test_workers_of_a_loader_made_on_a_thread_die_with_the_sigkilled_trainer(image_dir, tmp_path):
    script = tmp_path / "on_a_thread.py"
    script.write_text(ON_A_THREAD)
    proc = subprocess.Popen([sys.executable, str(script), image_dir], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True, env=env(), start_new_session=True)
    tree: list[Proc] = []
    try:
        busy: set[int] = set()
        deadline = time.monotonic() + 120
        while len(busy) < 2:  # both workers are inside the GIL-holding call (printed just before)
            line = readline(proc, max(0.0, deadline - time.monotonic()))
            assert line, f"both workers did not get busy within 120 s (rc={proc.poll()}): {busy}"
            if line.startswith("BUSY "):
                busy.add(int(line.split()[1]))
        tree = descendants(proc.pid)
        assert busy <= {p.pid for p in tree}, ([p.describe() for p in tree], busy)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        left = wait_gone(tree, ORPHAN_DEADLINE)
        assert not left, f"alive {ORPHAN_DEADLINE} s after the trainer's SIGKILL: " + "; ".join(
            p.describe() for p in left)
    finally:
        kill_group(proc, tree)
        if proc.stdout is not None:
            proc.stdout.close()
