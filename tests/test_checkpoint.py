"""Checkpointer behaviour in one process: exact resume, RNG, extras, policies, verification."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from shardloader.checkpoint import Checkpointer, CheckpointWarning
from shardloader.checkpoint.manifest import MANIFEST_NAME
from shardloader.errors import CheckpointError, StateError
from tests.fixtures.checkpoint import (
    CursorLoader,
    assert_tree_equal,
    loaded_state,
    new_run,
    one_thread,
    reference_state,
    train_step,
)


def save_run(ck: Checkpointer, step: int, run: dict):
    return ck.save(step, model=run["model"], optimizer=run["optimizer"], loader=run["loader"],
                   counter=run["counter"], meta=run["meta"])


def load_run(ck: Checkpointer, run: dict, step: int | None = None) -> int:
    return ck.load(step, model=run["model"], optimizer=run["optimizer"], loader=run["loader"],
                   counter=run["counter"], meta=run["meta"])


def ckpt_dirs(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    with one_thread(), Checkpointer(tmp_path / "ck") as ck:
        run = new_run()
        for step in range(1, 4):
            train_step(run)
            save_run(ck, step, run)
        ck.wait()
        for _ in range(3):  # the uninterrupted continuation
            train_step(run)
        expected = loaded_state(run)

        resumed = new_run()
        train_step(resumed)  # a different position everywhere, RNG included
        assert load_run(ck, resumed) == 3
        assert_tree_equal(reference_state(3), loaded_state(resumed))
        for _ in range(3):
            train_step(resumed)
        assert_tree_equal(expected, loaded_state(resumed))


def test_rng_draws_after_load_are_those_of_the_uninterrupted_run(tmp_path):
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    random.gauss(0, 1)  # python keeps a cached gaussian: part of its state
    np.random.standard_normal()  # numpy too
    with Checkpointer(tmp_path) as ck:
        ck.save(0).wait()
        expected = [random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(),
                    torch.rand(4)]
        random.seed(6)
        np.random.seed(6)
        torch.manual_seed(6)
        ck.load()
        got = [random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(),
               torch.rand(4)]
    assert got[:4] == expected[:4]
    assert torch.equal(got[4], expected[4])


def test_extras_of_every_supported_type_round_trip_exactly(tmp_path):
    state = {
        "ints": {1: "a", 2: (3, 4.5)},
        "floats": [float("nan"), float("inf"), -0.0, 1e-310, 0.1],
        "bytes": b"\x00\xff",
        "tuple_key": {(1, "x"): None},
        "marker_lookalike": {"__tensor__": 7},
        "np": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "np_str": np.array(["ab", "c"]),
        "np_scalar": np.float32(1.5),
        "dtype": torch.bfloat16,
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "complex": torch.randn(4, dtype=torch.complex64),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
    }
    with Checkpointer(tmp_path) as ck:
        ck.save(1, blob=state).wait()
        restored: dict = {}
        ck.load(blob=restored)
    np_keys = ("np", "np_str")
    for key in np_keys:
        assert restored[key].dtype == state[key].dtype and (restored[key] == state[key]).all()
    assert np.isnan(restored["floats"][0]) and restored["floats"][1:] == state["floats"][1:]
    assert str(restored["floats"][2]) == "-0.0"
    assert type(restored["np_scalar"]) is np.float32 and restored["np_scalar"] == 1.5
    for key in ("np", "np_str", "floats", "np_scalar"):
        del restored[key], state[key]
    state["noncontig"] = state["noncontig"].contiguous()
    assert_tree_equal(state, restored)


def test_values_that_need_pickle_are_refused_with_their_path(tmp_path):
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(CheckpointError, match=r"\['inner'\].*object"):
            ck.save(1, blob={"inner": object()})
        assert ck.steps() == []


def test_extras_restore_in_place_or_fail_before_touching_anything(tmp_path):
    run = new_run()
    with Checkpointer(tmp_path) as ck:
        save_run(ck, 1, run)
        ck.save(2, model=run["model"], epoch=7, meta=run["meta"]).wait()
        before = {k: v.clone() for k, v in run["model"].state_dict().items()}
        fresh = new_run()
        with pytest.raises(TypeError, match="epoch"):
            ck.load(model=fresh["model"], epoch=0)
        with pytest.raises(CheckpointError, match="no extra state 'missing'"):
            ck.load(model=fresh["model"], missing={})
        with pytest.raises(CheckpointError, match="no optimizer state"):
            ck.load(model=fresh["model"], optimizer=fresh["optimizer"])
        assert_tree_equal(new_run()["model"].state_dict(), fresh["model"].state_dict())
        ck.load(model=fresh["model"], meta=fresh["meta"])
        assert ck.loaded_extra["epoch"] == 7
        assert fresh["meta"] == run["meta"]
        assert_tree_equal(before, fresh["model"].state_dict())


def test_loader_fingerprint_mismatch_is_a_clear_error_naming_the_checkpoint(tmp_path):
    run = new_run()
    with Checkpointer(tmp_path) as ck:
        handle = ck.save(4, model=run["model"], loader=CursorLoader(fingerprint="fp-A"))
        handle.wait()
        other = new_run()
        untouched = {k: v.clone() for k, v in other["model"].state_dict().items()}
        with pytest.raises(StateError) as excinfo:
            ck.load(model=other["model"], loader=CursorLoader(fingerprint="fp-B"))
    message = str(excinfo.value)
    assert handle.id in message and "step 4" in message
    assert "'fp-A'" in message and "'fp-B'" in message
    assert isinstance(excinfo.value.__cause__, StateError)
    assert_tree_equal(untouched, other["model"].state_dict())  # nothing restored
    manifest = (tmp_path / handle.id / MANIFEST_NAME).read_text()
    assert '"loader_fingerprint": "fp-A"' in manifest


class Gate:
    """A phase hook that holds the writer at the start of `phase` until released."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, phase: str, ckpt_id: str, step: int) -> None:
        if phase == self.phase:
            self.reached.set()
            assert self.release.wait(30), "test gate never released"


def test_on_busy_skip_drops_the_save_and_counts_it(tmp_path):
    gate = Gate("upload")
    with Checkpointer(tmp_path, on_busy="skip", _phase_hook=gate) as ck:
        first = ck.save(1, x=torch.ones(3))
        assert gate.reached.wait(30)
        skipped = ck.save(2, x=torch.ones(3))
        assert skipped.skipped and skipped.done() and skipped.id is None
        assert ck.stats()["skipped"] == 1
        assert not first.done()
        gate.release.set()
        first.wait()
        assert ck.steps() == [1]


def _waiting_in_save(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked in a threading wait (an Event, a Condition) that it entered
    from a Checkpointer's save(): a save waiting for the one in flight."""
    frame = sys._current_frames().get(thread.ident)
    calls = []
    while frame is not None:
        calls.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    checkpoint_dir = os.path.join("shardloader", "checkpoint", "")
    return (bool(calls) and calls[0][1] == "wait" and calls[0][0] == threading.__file__
            and any(checkpoint_dir in path and name == "save" for path, name in calls))


def test_on_busy_wait_blocks_until_the_previous_save_is_complete(tmp_path):
    gate = Gate("commit")
    with Checkpointer(tmp_path, on_busy="wait", _phase_hook=gate) as ck:
        ck.save(1, x=torch.ones(3))
        assert gate.reached.wait(30)
        gate.reached.clear()
        result = {}
        saver = threading.Thread(target=lambda: result.setdefault("h", ck.save(2, x=torch.ones(3))))
        saver.start()
        # Release the gate only once save(2) waits for save 1 (a started thread may not be
        # in save() yet, and a save() called after save 1 ended does not wait at all).
        deadline = time.monotonic() + 30
        while not _waiting_in_save(saver):
            assert saver.is_alive(), "save() returned while the previous save was in flight"
            assert time.monotonic() < deadline, "save() never waited for the save in flight"
            time.sleep(0.01)
        assert ck.steps() == []
        gate.release.set()
        saver.join(30)
        result["h"].wait()
        stats = ck.stats()
    assert stats["busy_waits"] == 1 and stats["busy_wait_s_total"] > 0
    assert result["h"].timings["busy_wait_s"] > 0
    assert ck.steps() == [1, 2]


def test_failed_background_write_is_raised_on_the_next_call_and_never_listed(tmp_path):
    boom = RuntimeError("boom")

    def hook(phase, ckpt_id, step):
        if step == 2 and phase == "commit":
            raise boom

    ck = Checkpointer(tmp_path, _phase_hook=hook)
    ck.save(1, x=torch.ones(2)).wait()
    ck.save(2, x=torch.ones(2))
    with pytest.raises(CheckpointError, match=r"step 2 .*failed during commit: RuntimeError: boom") as e:
        ck.save(3, x=torch.ones(2))
    assert e.value.__cause__ is boom
    assert ck.steps() == [1] and ck.latest() == 1
    assert len(ckpt_dirs(tmp_path)) == 1  # the failed one was removed
    ck.save(3, x=torch.ones(2))  # the error was delivered once; saving goes on
    ck.wait()
    ck.save(2, x=torch.ones(2))
    with pytest.raises(CheckpointError, match="boom"):
        ck.close()
    assert ck.steps() == [1, 3]
    assert ck.stats()["failed"] == 2


def test_handle_wait_reports_the_failure_once(tmp_path):
    def hook(phase, ckpt_id, step):
        if phase == "upload":
            raise OSError(5, "I/O error")

    ck = Checkpointer(tmp_path, _phase_hook=hook)
    handle = ck.save(1, x=torch.ones(2))
    with pytest.raises(CheckpointError, match="failed during upload") as e:
        handle.wait()
    assert isinstance(e.value.__cause__, OSError)
    ck.close()  # already reported through the handle


def test_close_is_bounded_by_timeout_when_a_save_is_stuck(tmp_path):
    gate = Gate("upload")
    ck = Checkpointer(tmp_path, _phase_hook=gate, timeout=timedelta(seconds=1))
    handle = ck.save(1, x=torch.ones(2))
    assert gate.reached.wait(30)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"step 1 .*still in flight after 1 s"):
        ck.close()
    assert time.monotonic() - t0 < 10
    gate.release.set()
    handle.wait(30)  # the writer was left running, not killed: it still commits
    assert ck.steps() == [1]


EXIT_SCRIPT = """
import sys, threading, torch
from datetime import timedelta
from shardloader.checkpoint import Checkpointer
never = threading.Event()
hook = lambda phase, ckpt_id, step: never.wait() if phase == "upload" else None
ck = Checkpointer(sys.argv[1], timeout=timedelta(seconds=2), _phase_hook=hook)
ck.save(1, x=torch.ones(2))
print("saved", flush=True)
"""


def test_interpreter_exit_with_a_stuck_save_and_no_close_is_bounded(tmp_path):
    """The script ends without close() while its save hangs: it exits after `timeout`, saying
    the save was abandoned, instead of joining the writer forever."""
    t0 = time.monotonic()
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "saved"
    assert "abandoned" in proc.stderr and "step 1" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    with Checkpointer(tmp_path, keep=2) as ck:
        for step in range(1, 6):
            ck.save(step, x=torch.full((2,), float(step)))
        ck.wait()
        assert ck.steps() == [4, 5]
    assert len(ckpt_dirs(tmp_path)) == 2


def test_resaving_a_step_gets_a_new_id_and_becomes_the_newest(tmp_path):
    with Checkpointer(tmp_path, keep=None) as ck:
        first = ck.save(3, tag={"v": 1})
        first.wait()
        second = ck.save(3, tag={"v": 2})
        second.wait()
        assert first.id != second.id and ck.steps() == [3, 3]
        tag: dict = {}
        ck.load(3, tag=tag)
        assert tag == {"v": 2}
        assert (tmp_path / first.id / MANIFEST_NAME).exists()


def test_commit_order_decides_newest_after_a_rollback(tmp_path):
    with Checkpointer(tmp_path, keep=None) as ck:
        for step in (10, 20, 15):
            ck.save(step, tag={"step": step}).wait()
        assert ck.steps() == [10, 20, 15] and ck.latest() == 15


def flip_byte(path, offset_from_end: int = 10) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("damage", ["tensor_byte", "json_byte", "manifest_byte", "truncate"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, damage):
    with Checkpointer(tmp_path, keep=None) as ck:
        ck.save(1, x={"v": torch.arange(1000.0)}).wait()
        newest = ck.save(2, x={"v": torch.arange(1000.0) * 2})
        newest.wait()
        target = tmp_path / newest.id
        if damage == "tensor_byte":
            flip_byte(target / "state.safetensors")
        elif damage == "json_byte":
            flip_byte(target / "state.json", 3)
        elif damage == "manifest_byte":
            flip_byte(target / MANIFEST_NAME, 40)
        else:
            with open(target / "state.safetensors", "r+b") as f:
                f.truncate(os.path.getsize(target / "state.safetensors") - 4)
        with pytest.warns(CheckpointWarning, match=newest.id):
            assert ck.latest() == 1
        out: dict = {}
        with pytest.warns(CheckpointWarning, match=newest.id):
            assert ck.load(x=out) == 1
        assert torch.equal(out["v"], torch.arange(1000.0))
        if damage != "manifest_byte":
            with pytest.raises(CheckpointError, match=newest.id):
                ck.load(2, x=out)


def test_startup_removes_incomplete_leftovers_and_keeps_complete_ones(tmp_path):
    with Checkpointer(tmp_path) as ck:
        done = ck.save(1, x=torch.ones(2))
    leftover = tmp_path / "step-0000000002-0123abcd000001"
    leftover.mkdir()
    (leftover / "state.safetensors").write_bytes(b"partial")
    staged = tmp_path / ".staging" / "rank-00000" / "step-0000000002-0123abcd000001"
    staged.mkdir(parents=True)
    (staged / "state.safetensors").write_bytes(b"partial")
    (tmp_path / "unrelated.txt").write_text("keep me")
    with Checkpointer(tmp_path) as ck:
        assert ckpt_dirs(tmp_path) == [done.id]
        assert not staged.exists()
        assert (tmp_path / "unrelated.txt").exists()
        assert ck.latest() == 1


def test_state_larger_than_the_pool_streams_through_it(tmp_path):
    tensors = {f"t{i}": torch.randn(3000 + i) for i in range(5)}  # ~60 KB, pool 4 KB
    tensors["odd"] = torch.arange(7, dtype=torch.int8)
    with Checkpointer(tmp_path, staging_bytes=4096) as ck:
        handle = ck.save(1, tensors=tensors)
        handle.wait()
        assert ck.stats()["pool_bytes"] <= 4096
        out: dict = {}
        ck.load(tensors=out)
    assert_tree_equal(tensors, out)


def test_pool_is_allocated_once_and_reused(tmp_path):
    run = new_run(big=4096)
    with Checkpointer(tmp_path) as ck:
        for step in range(1, 5):
            train_step(run)
            save_run(ck, step, run)
        ck.wait()
        stats = ck.stats()
    assert stats["pool_allocations"] == 1 and stats["committed"] == 4


class RecordingTelemetry:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.calls.append((dict(metrics), step))


def test_phase_timings_reach_stats_handle_and_telemetry(tmp_path):
    telemetry = RecordingTelemetry()
    with Checkpointer(tmp_path, telemetry=telemetry) as ck:
        handle = ck.save(7, x=torch.ones(1000))
        handle.wait()
        last = ck.stats()["last"]
    phases = ["stage_s", "write_s", "upload_s", "commit_s", "retention_s", "blocking_s", "total_s"]
    for key in phases:
        assert handle.timings[key] >= 0 and last[key] == handle.timings[key]
    assert telemetry.calls, "telemetry got nothing"
    metrics, step = telemetry.calls[-1]
    assert step == 7 and metrics["checkpoint/bytes"] == 4000.0
    assert {f"checkpoint/{k}" for k in phases} <= set(metrics)


def test_empty_root_has_no_latest_and_load_says_so(tmp_path):
    with Checkpointer(tmp_path) as ck:
        assert ck.latest() is None and ck.steps() == []
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            ck.load()
        ck.save(1, x=torch.ones(1)).wait()
        with pytest.raises(CheckpointError, match=r"no complete checkpoint of step 5 .*\[1\]"):
            ck.load(5)


def test_closed_checkpointer_refuses_calls(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.close()
    ck.close()
    with pytest.raises(CheckpointError, match="closed"):
        ck.save(1)


def test_s3_destination_round_trip(s3_server, s3_bucket, tmp_path):
    run = new_run()
    with one_thread(), Checkpointer(f"s3://{s3_bucket}/run", keep=2, staging_dir=tmp_path / "stage",
                                    storage_options=s3_server.storage_options()) as ck:
        for step in range(1, 4):
            train_step(run)
            save_run(ck, step, run)
        ck.wait()
        assert ck.steps() == [2, 3] and ck.latest() == 3
        resumed = new_run()
        assert load_run(ck, resumed) == 3
        assert_tree_equal(reference_state(3), loaded_state(resumed))


def test_real_loader_resumes_with_the_next_batch_and_refuses_another_fingerprint(tmp_path, arrow_dataset):
    from shardloader import Dataset, Loader

    def make_loader(seed: int) -> Loader:
        return Loader(Dataset(arrow_dataset.path), batch_size=8, seed=seed, num_workers=0)

    loader = make_loader(seed=0)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    with Checkpointer(tmp_path) as ck:
        handle = ck.save(3, loader=loader)
        handle.wait()
        expected = next(batches)

        resumed = make_loader(seed=0)
        ck.load(loader=resumed)
        got = next(iter(resumed))
        assert torch.equal(got["__index__"], expected["__index__"])
        assert torch.equal(got["vec"], expected["vec"])

        with pytest.raises(StateError, match=rf"{handle.id}.*seed") as excinfo:
            ck.load(loader=make_loader(seed=1))
    assert "step 3" in str(excinfo.value)
