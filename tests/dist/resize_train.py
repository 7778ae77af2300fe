"""One rank of a training run that tests/test_resize.py starts under torchrun with 4, 2 and 8
ranks: two simulated nodes (ranks [0, W/2) and [W/2, W)), each with its own cache directory,
read one dataset from loopback S3 through shardloader's Loader; the model is sharded with FSDP2
(`torch.distributed.fsdp.fully_shard`, gloo on CPU) and trained with AdamW; the Checkpointer saves
model, optimizer (DCP: sharded, resharded on load) and loader every `--every` steps.

On start, a run loads the newest checkpoint when there is one, and rank 0 writes the gathered
full model and optimizer state it restored (`<name>-loaded.pt`); after each save it writes the
gathered state it saved (`<name>-saved-<step>.pt`), and at the end the final one
(`<name>-final.pt`). Each rank appends one JSON line per step to `<name>-<rank>.jsonl`: the step,
the epoch, the batch's global sample indices and the augmented crops. With `--wait-after N` the
run stops after step N, once its last save is complete, prints ``STEP N`` and waits to be
killed.
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardloader import Dataset, Loader
from shardloader.checkpoint import Checkpointer
from tests.sample_transforms import noisy_crop

GLOBAL_BATCH = 8


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same initial model on every rank and world size, sharded over all ranks. The last
    layer's 7 rows do not divide among 2, 4 or 8 ranks: FSDP2 shards it unevenly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 7))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole model and optimizer state, gathered from every rank (a collective call)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--url", "--endpoint", "--cache-root", "--ckpt", "--out", "--name"):
        p.add_argument(name, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--wait-after", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = rank // max(1, world // 2)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": args.endpoint, "region_name": "us-east-1"}}
    dataset = Dataset(args.url, cache_dir=os.path.join(args.cache_root, f"node{node}"), cache_limit="64MB",
                      storage_options=options)
    loader = Loader(dataset, batch_size=GLOBAL_BATCH // world, shuffle=True, seed=7, transform=noisy_crop,
                    partitions=8, num_workers=0)
    model, optimizer = build(world)
    ck = Checkpointer(args.ckpt, keep=None)
    out = os.path.join(args.out, args.name)
    step = 0
    if ck.latest() is not None:
        step = ck.load(model=model, optimizer=optimizer, loader=loader)
        state = full_state(model, optimizer)
        if rank == 0:
            torch.save({"step": step, **state}, f"{out}-loaded.pt")
    record = open(f"{out}-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - closed below
    epochs = -(-args.steps // len(loader))
    for epoch in range(loader.epoch, epochs):  # the same loop for a fresh and a resumed run
        if step >= args.steps:
            break
        loader.set_epoch(epoch)
        for batch in loader:
            loss = F.cross_entropy(model(batch["crop"].float() / 255), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            record.write(json.dumps({"step": step, "epoch": epoch, "indices": batch["__index__"].tolist(),
                                     "crops": [c.numpy().tobytes().hex() for c in batch["crop"]]}) + "\n")
            if step % args.every == 0:
                ck.save(step, model=model, optimizer=optimizer, loader=loader)
                state = full_state(model, optimizer)
                if rank == 0:
                    torch.save({"step": step, **state}, f"{out}-saved-{step}.pt")
            if step == args.wait_after:  # the test kills the run here
                ck.wait()
                dist.barrier()
                if rank == 0:
                    print(f"STEP {step}", flush=True)
                threading.Event().wait()
            if step >= args.steps:
                break
    ck.wait()
    ck.close()
    record.close()
    state = full_state(model, optimizer)
    if rank == 0:
        torch.save({"step": step, **state}, f"{out}-final.pt")
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
