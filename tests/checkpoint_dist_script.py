"""Two-rank checkpoint scenario, run by tests/test_checkpoint_distributed.py.

`torchrun --nproc_per_node 2 tests/checkpoint_dist_script.py save ROOT OUT`: for a DDP model
and an FSDP2 model (ROOT/ddp, ROOT/fsdp), each rank trains a few steps (gloo, CPU), saves every
step through the Checkpointer (DCP for model and optimizer, a part per rank for loader and RNG),
then loads the newest checkpoint into fresh objects and checks model, optimizer, loader and the
next random draws against what it saved. Rank 0 writes the expected full states to OUT.

Before that, the test calls `make_single(ROOT/single, OUT)` in its own process: a checkpoint
written by one process, which both ranks then load into their DDP models.

`python tests/checkpoint_dist_script.py load1 ROOT OUT`: world size 1, no process group: loads
both checkpoints into plain models (DCP reshards the FSDP one) and compares with OUT.
Each process writes OUT/result-<mode>-<rank>.json; the test asserts on them.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from shardloader.checkpoint import Checkpointer
from shardloader.errors import CheckpointError, StateError

STEPS = 3


class Loader:
    """Per-rank cursor with a fingerprint, like shardloader's Loader."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        return torch.randn(4, 8, generator=g)

    def state_dict(self) -> dict:
        return {"position": self.position, "rank": self.rank, "fingerprint": "fp"}

    def load_state_dict(self, state: dict) -> None:
        if state["fingerprint"] != "fp":
            raise StateError("fingerprint differs")
        self.position = state["position"]


def build(kind: str, distributed: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    if distributed and kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif distributed and kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def full_states(model, optimizer) -> dict:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=opts),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=opts)}


def compare(a, b, path="state") -> list[str]:
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [f"{path} differs"]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b or {}))}"]
        return [d for k in a for d in compare(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in compare(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def save_kind(root: str, out: str, kind: str) -> dict:
    rank = dist.get_rank()
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(100 + rank)
    model, optimizer = build(kind, True)
    loader = Loader(rank)
    ck = Checkpointer(root, keep=2)
    for step in range(1, STEPS + 1):
        loss = model(loader.next_batch()).pow(2).mean() * (1 + random.random() * 1e-3)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ck.save(step, model=model, optimizer=optimizer, loader=loader, note={"rank": rank})
    ck.wait()
    expected = full_states(model, optimizer)
    expected_loader = loader.state_dict()
    expected_draws = draws()
    if rank == 0:
        torch.save(expected, os.path.join(out, f"expected-{kind}.pt"))
    model2, optimizer2 = build(kind, True)
    # A different RNG position before loading: load must restore it.
    random.seed(99)
    torch.manual_seed(99)
    loader2 = Loader(rank)
    note: dict = {}
    step = ck.load(model=model2, optimizer=optimizer2, loader=loader2, note=note)
    got_draws = draws()
    problems = compare(expected, full_states(model2, optimizer2))
    result = {
        "rank": rank, "step": step, "steps": ck.steps(), "latest": ck.latest(),
        "problems": problems, "loader_ok": loader2.state_dict() == expected_loader,
        "draws_ok": got_draws == expected_draws, "note": note,
        "committed": ck.stats()["committed"],
    }
    if rank == 0:
        result["payload"] = dcp_payload(os.path.join(root, ck._store.list_ids()[-1]))
    ck.close()
    return result


def dcp_payload(path: str) -> dict:
    """Bytes in DCP's data files vs bytes its metadata references: equal when no rank wrote
    data that another rank also wrote (replicas deduplicated)."""
    from shardloader.checkpoint.untrusted import MetadataUnpickler

    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = MetadataUnpickler(f).load()
    referenced = sum(info.length for info in metadata.storage_data.values())
    files = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp"))
    return {"referenced": referenced, "file_bytes": files}


def single_kind(root: str, out: str) -> dict:
    """A checkpoint written by one process (the test wrote it) loaded by every rank into DDP."""
    import warnings

    rank = dist.get_rank()
    model, optimizer = build("ddp", True)
    loader = Loader(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(root) as ck:
            step = ck.load(model=model, optimizer=optimizer, loader=loader)
    expected = torch.load(os.path.join(out, "expected-single.pt"), weights_only=True)
    problems = compare(expected["model"], model.module.state_dict())
    problems += compare(expected["optimizer"], optimizer.state_dict())
    return {"rank": rank, "step": step, "problems": problems, "loader_position": loader.position,
            "warned": any("saved by one process" in str(w.message) for w in caught)}


def make_single(root: str, out: str) -> None:
    """Run by the test in its own process: a one-process checkpoint of the same model."""
    model, optimizer = build("ddp", False)
    loader = Loader(0)
    model(loader.next_batch()).sum().backward()
    optimizer.step()
    with Checkpointer(root) as ck:
        ck.save(1, model=model, optimizer=optimizer, loader=loader)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(out, "expected-single.pt"))


def save_mode(root: str, out: str) -> dict:
    dist.init_process_group("gloo")
    try:
        result = {kind: save_kind(os.path.join(root, kind), out, kind) for kind in ("ddp", "fsdp")}
        result["single"] = single_kind(os.path.join(root, "single"), out)
        return result
    finally:
        dist.barrier()
        dist.destroy_process_group()


def load1_mode(root: str, out: str) -> dict:
    return {kind: load1_kind(os.path.join(root, kind), out, kind) for kind in ("ddp", "fsdp")}


def load1_kind(root: str, out: str, kind: str) -> dict:
    model, optimizer = build(kind, False)
    loader = Loader(0)
    expected = torch.load(os.path.join(out, f"expected-{kind}.pt"), weights_only=True)
    with Checkpointer(root) as ck:
        step = ck.load(model=model, optimizer=optimizer, loader=loader)
    problems = compare(expected, full_states(model, optimizer))
    return {"rank": 0, "step": step, "problems": problems, "loader_position": loader.position}


def train(model, optimizer, loader) -> None:
    model(loader.next_batch()).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def untrusted_mode(root: str, out: str) -> dict:
    """A value whose unpickling runs code is refused at save; then for each attack (a value,
    `.metadata`, a tensor item rewritten, manifest fixed up) the newest checkpoint is skipped
    by latest() and load() alike, and nothing runs."""
    import copy
    import pickle
    import warnings

    from tests.fixtures.checkpoint import Evil, evil_pickle, fix_up_manifest, replace_dcp_item

    marker = os.path.join(out, "ran")

    def bad_metadata(path: str) -> None:
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Evil(marker), f)
        fix_up_manifest(path)

    attacks = {
        "value": lambda path: replace_dcp_item(
            path, lambda fqn: fqn.startswith("optimizer.param_groups") and fqn.endswith(".lr"),
            evil_pickle(marker)),
        "metadata": bad_metadata,
        "tensor": lambda path: replace_dcp_item(path, lambda fqn: fqn.startswith("model."),
                                                b"not a tensor" * 7),
    }
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model, optimizer = build("ddp", True)
        loader = Loader(rank)
        ck = Checkpointer(os.path.join(root, "untrusted"), keep=None)
        optimizer.param_groups[0]["hook"] = Evil(marker)
        try:
            ck.save(1, model=model, optimizer=optimizer, loader=loader)
            refused = None
        except CheckpointError as exc:
            refused = str(exc)
        del optimizer.param_groups[0]["hook"]
        cases, step = [], 0
        for kind, attack in attacks.items():
            step += 1
            train(model, optimizer, loader)
            ck.save(step, model=model, optimizer=optimizer, loader=loader).wait()
            good = copy.deepcopy(full_states(model, optimizer))  # the live tensors move on
            step += 1
            train(model, optimizer, loader)
            bad = ck.save(step, model=model, optimizer=optimizer, loader=loader)
            bad.wait()
            dist.barrier()
            if rank == 0:
                attack(os.path.join(root, "untrusted", bad.id))
            dist.barrier()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                latest = ck.latest()
                model2, optimizer2 = build("ddp", True)
                loaded = ck.load(model=model2, optimizer=optimizer2, loader=Loader(rank))
            cases.append({"kind": kind, "good": step - 1, "latest": latest, "loaded": loaded,
                          "problems": compare(good, full_states(model2, optimizer2)),
                          "warned": any(bad.id in str(w.message) for w in caught)})
        ck.close()
        return {"rank": rank, "refused": refused, "cases": cases, "ran": os.path.exists(marker)}
    finally:
        dist.barrier()
        dist.destroy_process_group()


def rank0_mode(root: str, out: str) -> dict:
    """`if rank == 0: ckpt.save(...)`: rank 0 gets a clear error in bounded time, while rank 1
    waits in a collective of the training group, after rank 1 closed its checkpointer, and
    (both ranks) while rank 1 is in `load` instead."""
    import time
    from datetime import timedelta

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model, optimizer = build("ddp", True)
        result: dict = {"rank": rank}
        for case, timeout in (("busy", 6), ("closed", 120), ("other", 120)):
            ck = Checkpointer(os.path.join(root, case), timeout=timedelta(seconds=timeout))
            if case == "closed" and rank == 1:
                ck.close()
            if case == "closed":
                dist.barrier()
            if case == "other" and rank == 1:  # rank 1 in another collective call
                t0 = time.monotonic()
                try:
                    ck.load()
                    error = None
                except CheckpointError as exc:
                    error = str(exc)
                result[case] = {"error": error, "seconds": time.monotonic() - t0}
            if rank == 0:
                t0 = time.monotonic()
                try:
                    ck.save(1, model=model, optimizer=optimizer)
                    ck.wait()
                    error = None
                except CheckpointError as exc:
                    error = str(exc)
                result[case] = {"error": error, "seconds": time.monotonic() - t0}
            dist.barrier()  # rank 1 waits here, as in its next step's all-reduce
            ck.close()
        return result
    finally:
        dist.barrier()
        dist.destroy_process_group()


MODES = {"save": save_mode, "load1": load1_mode, "untrusted": untrusted_mode, "rank0": rank0_mode}


def main() -> None:
    mode, root, out = sys.argv[1:4]
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = MODES[mode](root, out)
    except BaseException:
        result = {"rank": rank, "error": traceback.format_exc()}
    with open(os.path.join(out, f"result-{mode}-{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    if "error" in result:
        print(result["error"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
