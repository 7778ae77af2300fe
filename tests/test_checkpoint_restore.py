"""`Checkpointer.load()` is all or nothing, and `latest()` and `load()` agree on what is usable.

Issue 25 items 2 and 3. Every test writes a real checkpoint with the Checkpointer, through a
real model, AdamW optimizer and shardloader `Loader` (no workers), then loads it into objects of
which exactly one does not fit. The load must raise a clear error and leave every object (model
parameters and buffers, optimizer state, the loader's state and its next batch, the global RNGs
of python, numpy and torch, the extras) bit-identical to what it was before the call.
"""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import numpy as np
import pytest
import torch

from shardloader import Dataset, Loader
from shardloader.checkpoint import Checkpointer, CheckpointWarning
from shardloader.checkpoint import rng as rng_state
from shardloader.checkpoint.manifest import MANIFEST_NAME, Manifest
from shardloader.errors import CheckpointError, StateError
from tests.fixtures.checkpoint import Counter, CursorLoader, TinyNet, assert_tree_equal, one_thread

SAVED_STEPS = 3


def make_loader(path: str, *, seed: int = 0) -> Loader:
    return Loader(Dataset(path), batch_size=8, seed=seed, num_workers=0)


def make_run(path: str, *, big: int = 64, hidden: int = 16, loader_seed: int = 0,
             optimizer_of: torch.nn.Module | None = None) -> dict[str, Any]:
    """A model, an optimizer (over `optimizer_of`'s parameters when given: another model's),
    a real Loader and two extras, all at step 0."""
    model = TinyNet(dim=3, hidden=hidden, big=big)
    params = (optimizer_of or model).parameters()
    return {"model": model, "optimizer": torch.optim.AdamW(params, lr=1e-2),
            "loader": make_loader(path, seed=loader_seed), "counter": Counter(),
            "meta": {"losses": []}}


def train(run: dict[str, Any], steps: int) -> None:
    """`steps` steps on the loader's batches; dropout draws from torch's global RNG, the loss
    scale from python's and numpy's, so every generator moves."""
    model, optimizer = run["model"], run["optimizer"]
    batches = iter(run["loader"])
    for _ in range(steps):
        batch = next(batches)
        scale = 1.0 + 1e-3 * (random.random() + float(np.random.rand()))
        out = model.fc2(model.drop(model.fc1(batch["vec"]).relu()))
        loss = torch.nn.functional.mse_loss(out.squeeze(1), batch["label"].float()) * scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.history.mul_(0.5).add_(loss.detach())
        run["counter"].n += 1
        run["meta"]["losses"].append(float(loss.detach()))


def save(ck: Checkpointer, step: int, run: dict[str, Any]) -> None:
    ck.save(step, model=run["model"], optimizer=run["optimizer"], loader=run["loader"],
            counter=run["counter"], meta=run["meta"]).wait()


def load(ck: Checkpointer, run: dict[str, Any], step: int | None = None) -> int:
    return ck.load(step, model=run["model"], optimizer=run["optimizer"], loader=run["loader"],
                   counter=run["counter"], meta=run["meta"])


def snapshot(run: dict[str, Any]) -> dict[str, Any]:
    """Deep copies of every state a load could change."""
    return copy.deepcopy({
        "model": run["model"].state_dict(),
        "optimizer": run["optimizer"].state_dict(),
        "loader": run["loader"].state_dict(),
        "counter": run["counter"].state_dict(),
        "meta": run["meta"],
        "rng": rng_state.capture(),
    })


def assert_untouched(before: dict[str, Any], run: dict[str, Any], path: str) -> None:
    """Every state is bit for bit what it was, and the loader still yields what a twin that
    never saw the failed load yields (a peek would see a restored position)."""
    assert_tree_equal(before, snapshot(run))
    twin = make_loader(path, seed=run["loader"].seed)
    got, expected = next(iter(run["loader"])), next(iter(twin))
    assert torch.equal(got["__index__"], expected["__index__"])


@pytest.fixture
def saved(tmp_path, arrow_dataset):
    """A checkpoint of step 3 (the loader at batch 3, every generator moved), and a live run
    that trained one step of its own (so every state differs from the checkpoint's)."""
    with one_thread():
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        run = make_run(arrow_dataset.path)
        train(run, SAVED_STEPS)
        ck = Checkpointer(tmp_path / "ck")
        save(ck, SAVED_STEPS, run)
        yield ck, arrow_dataset.path
        ck.close()


def live_run(path: str, **kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    run = make_run(path, **kwargs)
    if "optimizer_of" not in kwargs:
        train(run, 1)
    run["loader"] = make_loader(path, seed=kwargs.get("loader_seed", 0))  # fresh: at epoch 0
    return run


# ------------------------------------------------------------------------------ item 2
def test_a_model_that_does_not_fit_changes_nothing(saved):
    ck, path = saved
    run = live_run(path, big=48)
    before = snapshot(run)
    with pytest.raises(StateError) as excinfo:
        load(ck, run)
    message = str(excinfo.value)
    assert "step 3" in message and "model" in message and "history" in message
    assert "[64]" in message and "[48]" in message
    assert_untouched(before, run, path)


def test_a_model_of_another_dtype_loads_cast_as_torch_does(saved):
    """torch's load_state_dict copies into the live tensor, casting its dtype; so does load."""
    ck, path = saved
    run = live_run(path)
    run["model"].history.data = run["model"].history.data.double()
    load(ck, run)
    reference = live_run(path)
    load(ck, reference)
    assert run["model"].history.dtype == torch.float64
    assert torch.equal(run["model"].history, reference["model"].history.double())


@pytest.mark.parametrize("other", ["same_count_other_shapes", "more_parameters"])
def test_an_optimizer_of_another_model_changes_nothing(saved, other):
    ck, path = saved
    another = TinyNet(dim=3, hidden=17) if other == "same_count_other_shapes" else torch.nn.Sequential(
        TinyNet(dim=3), torch.nn.Linear(2, 2))
    run = live_run(path, optimizer_of=another)
    before = snapshot(run)
    with pytest.raises(StateError) as excinfo:
        load(ck, run)
    message = str(excinfo.value)
    assert "step 3" in message and "optimizer" in message
    if other == "same_count_other_shapes":  # torch's own load_state_dict would accept this one
        assert "[16, 3]" in message and "[17, 3]" in message
    else:
        assert "4 parameters" in message and "6" in message
    assert_untouched(before, run, path)


def test_a_loader_with_another_fingerprint_changes_nothing(saved):
    ck, path = saved
    run = live_run(path, loader_seed=5)
    before = snapshot(run)
    with pytest.raises(StateError, match=r"step 3.*seed: saved 0, now 5"):
        load(ck, run)
    assert_untouched(before, run, path)


class VersionedCounter(Counter):
    """A Stateful extra whose state has a version the checkpoint's (a plain Counter's) lacks.
    Nothing can check it beforehand, and it changes itself before it refuses: the parts
    applied before it, and its own half-applied state, must be put back."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "version": 2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]
        if state.get("version") != 2:
            raise StateError(f"counter state version {state.get('version')!r} is not 2")


def test_a_part_that_fails_while_applied_is_rolled_back(saved):
    ck, path = saved
    run = live_run(path)
    run["counter"] = VersionedCounter()
    run["counter"].n = 1
    before = snapshot(run)
    with pytest.raises(StateError, match=r"step 3.*extra state 'counter'.*version None is not 2"):
        load(ck, run)
    assert_untouched(before, run, path)


def test_a_stand_in_loader_that_refuses_the_state_is_applied_last(tmp_path):
    """A loader that is not shardloader's cannot be checked beforehand: it is applied after
    everything else, and the rest is put back when it refuses."""
    with one_thread(), Checkpointer(tmp_path) as ck:
        model = TinyNet(dim=3, big=8)
        ck.save(2, model=model, loader=CursorLoader(fingerprint="fp-A"), counter=Counter()).wait()
        live = TinyNet(dim=3, big=8)
        counter = Counter()
        counter.n = 9
        loader = CursorLoader(fingerprint="fp-B")
        loader.position = 4
        before = copy.deepcopy({"model": live.state_dict(), "counter": counter.state_dict(),
                                "loader": loader.state_dict(), "rng": rng_state.capture()})
        with pytest.raises(StateError, match=r"step 2.*'fp-A'.*'fp-B'"):
            ck.load(model=live, loader=loader, counter=counter)
        assert_tree_equal(before, {"model": live.state_dict(), "counter": counter.state_dict(),
                                   "loader": loader.state_dict(), "rng": rng_state.capture()})


def test_after_a_refused_load_the_right_objects_load_exactly(saved):
    ck, path = saved
    wrong = live_run(path, big=48)
    with pytest.raises(StateError):
        load(ck, wrong)
    right = live_run(path)
    assert load(ck, right) == SAVED_STEPS
    state = snapshot(right)
    torch.manual_seed(0)  # recompute the saved run: its states right after step 3
    random.seed(0)
    np.random.seed(0)
    with one_thread():
        reference = make_run(path)
        train(reference, SAVED_STEPS)
    assert_tree_equal(snapshot(reference), state)


# ------------------------------------------------------------------------------ item 3
def drop_from_manifest(ckpt_dir: str, name: str) -> None:
    """Rewrite the manifest without `name` (its own checksum fixed up: the manifest is intact,
    it just does not list a file the checkpoint needs)."""
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    with open(path, "rb") as f:
        manifest = Manifest.from_json(f.read(), source=path)
    del manifest.files[name]
    with open(path, "wb") as f:
        f.write(manifest.to_json())


@pytest.mark.parametrize("dropped", ["state.json", "state.safetensors"])
def test_latest_and_load_agree_on_a_manifest_that_omits_a_file(tmp_path, dropped):
    with one_thread(), Checkpointer(tmp_path) as ck:
        for step in (1, 2):
            ck.save(step, model=TinyNet(dim=3, big=8), counter=Counter()).wait()
        second = next(n for n in os.listdir(tmp_path) if n.startswith("step-0000000002"))
        drop_from_manifest(str(tmp_path / second), dropped)
        assert ck.steps() == [1, 2]  # the manifest itself is intact
        with pytest.warns(CheckpointWarning, match=rf"{second}.*lists no {dropped}"):
            assert ck.latest() == 1
        with pytest.warns(CheckpointWarning, match=rf"{second}.*lists no {dropped}"):
            assert ck.latest(verify=False) == 1  # read from the manifest alone
        with pytest.warns(CheckpointWarning, match=rf"{second}.*lists no {dropped}"):
            assert ck.load(model=TinyNet(dim=3, big=8), counter=Counter()) == 1
        with pytest.raises(CheckpointError, match=rf"{second}.*lists no {dropped}"):
            ck.load(2, model=TinyNet(dim=3, big=8))
