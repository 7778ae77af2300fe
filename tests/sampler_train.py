"""Child for tests/test_sampler_resume.py: runs a case of tests/sampler_cases.py over its epochs
with real worker processes, records every step, and saves the loaders' states after each.

    python -m tests.sampler_train CASE --workers W --world R --epochs E --out DIR [--resume]
                                        [--pause-at N]

Each step appends one line to DIR/records.jsonl — the step's samples in global order (under
world size 2 the two ranks' batches interleaved: rank r holds a global batch's items r, r + 2,
...), each as [index, sha256 of the sample's bytes] — and then replaces DIR/state.json (through
a rename, so a SIGKILL leaves the old one or the new one) with the number of steps recorded and
every rank's `state_dict()`; then prints "step N" (and, at `--pause-at N`, waits on stdin: the
test kills it there, its workers busy on the batches ahead). `--resume` loads DIR/resume.json first
(rank r's state, or rank 0's for every rank when the world size changed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import torch

from tests.sampler_cases import make_loader


def sample_rows(batch: Any, indices: Any) -> list[list[Any]]:
    """[index, sha256 of every field's bytes] for each sample of a collated dict batch."""
    rows = []
    for k, index in enumerate(indices.tolist()):
        digest = hashlib.sha256()
        for name in sorted(batch):
            value = batch[name][k]
            digest.update(name.encode())
            digest.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
        rows.append([int(index), digest.hexdigest()[:16]])
    return rows


def run(case: str, *, workers: int, world: int, epochs: int, out: str, resume: bool,
        pause_at: int | None = None) -> list[list[list[Any]]]:
    """The epoch loop; returns the steps it recorded (also written to `out`, see module doc)."""
    loaders = [make_loader(case, num_workers=workers, rank=r, world_size=world) for r in range(world)]
    if resume:
        with open(os.path.join(out, "resume.json")) as f:
            saved = json.load(f)
        states = saved["states"]
        for r, loader in enumerate(loaders):
            loader.load_state_dict(states[r] if len(states) == world else states[0])
    count = saved["count"] if resume else 0
    steps: list[list[list[Any]]] = []
    records = open(os.path.join(out, "records.jsonl"), "a")
    try:
        for epoch in range(loaders[0].epoch, epochs):
            for loader in loaders:
                loader.set_epoch(epoch)
            for batches in zip(*loaders, strict=True):
                per_rank = [sample_rows(b, loader.last_indices) for b, loader in zip(batches, loaders)]
                merged: list[list[Any]] = [None] * sum(len(p) for p in per_rank)  # type: ignore[list-item]
                for r, rows in enumerate(per_rank):
                    merged[r::world] = rows
                steps.append(merged)
                count += 1
                records.write(json.dumps({"n": count, "epoch": epoch, "samples": merged}) + "\n")
                records.flush()
                state = {"count": count, "states": [loader.state_dict() for loader in loaders]}
                with open(os.path.join(out, "state.tmp"), "w") as f:
                    json.dump(state, f)
                os.replace(os.path.join(out, "state.tmp"), os.path.join(out, "state.json"))
                print(f"step {count}", flush=True)
                if count == pause_at:  # the parent kills it here, its workers busy ahead
                    sys.stdin.readline()
    finally:
        records.close()
        for loader in loaders:
            loader.close()
    return steps


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pause-at", type=int, default=None)
    args = parser.parse_args(argv)
    run(args.case, workers=args.workers, world=args.world, epochs=args.epochs, out=args.out,
        resume=args.resume, pause_at=args.pause_at)


if __name__ == "__main__":
    main(sys.argv[1:])
