"""A training loop over a two-source Mixture, for tests/test_mixture_loader.py's kill tests.

    python -m tests.mixture_train --data ARROW_DIR --out DIR --batches N [--workers W]
        [--resume] [--weights 0.5,0.5]

Sources with different fields made to agree by per-source transforms: "arrow" (a
shardloader.Dataset of `make_samples(..., array=True)`, field `vec`) and "squares" (a map-style
list). The Loader's transform adds noise from torch's global RNG, which the Loader keys per
sample, so a batch's bytes are a pure function of its samples. After each batch the loop appends
the batch's indices and bytes to `DIR/batches.jsonl`, writes the loader's state with the batch
count to `DIR/state.json` (atomically), then prints `batch <count>`; `--resume` continues from
that state. A test kills the process with SIGKILL when a line is printed.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
import torch

import shardloader

BATCH = 8
EPOCHS = 4


class Squares:
    """A map-style source: sample i is i squared (other fields than the Arrow source's)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"square": i * i}


def arrow_fields(record: dict[str, Any]) -> dict[str, Any]:
    return {"x": np.asarray(record["vec"], dtype=np.float32), "label": int(record["label"]),
            "__index__": record["__index__"]}


def square_fields(record: dict[str, Any]) -> dict[str, Any]:
    return {"x": np.full(3, float(record["square"]), dtype=np.float32), "label": record["square"] % 10,
            "__index__": -1}


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    sample["x"] = torch.as_tensor(sample["x"]) + torch.rand(3)
    return sample


def make_mixture(data: str, weights: tuple[float, float], squares: int = 37) -> shardloader.Mixture:
    """An epoch of 240 positions, a multiple of the global batch: no tail to pad or drop."""
    return shardloader.Mixture({
        "arrow": shardloader.MixtureSource(shardloader.Dataset(data), weights[0], arrow_fields),
        "squares": shardloader.MixtureSource(Squares(squares), weights[1], square_fields),
    }, epoch=240)


def make_loader(data: str, weights: tuple[float, float] = (0.6, 0.4), **kwargs: Any) -> shardloader.Loader:
    options = {"batch_size": BATCH, "shuffle": True, "seed": 5, "transform": augment, "tail": "pad"}
    options.update(kwargs)
    return shardloader.Loader(make_mixture(data, weights), **options)


def describe(batch: dict[str, Any]) -> dict[str, Any]:
    return {"indices": batch["__index__"].tolist(), "x": batch["x"].numpy().tobytes().hex(),
            "label": batch["label"].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--weights", default="0.6,0.4")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    weights = tuple(float(w) for w in args.weights.split(","))
    loader = make_loader(args.data, weights, num_workers=args.workers)  # type: ignore[arg-type]
    state_path = os.path.join(args.out, "state.json")
    done = 0
    if args.resume:
        with open(state_path) as f:
            saved = json.load(f)
        loader.load_state_dict(saved["state"])
        done = saved["batches"]
    with open(os.path.join(args.out, "batches.jsonl"), "a") as records:
        for epoch in range(loader.epoch, EPOCHS):
            loader.set_epoch(epoch)
            for batch in loader:
                records.write(json.dumps(describe(batch)) + "\n")
                records.flush()
                done += 1
                with open(state_path + ".tmp", "w") as f:
                    json.dump({"state": loader.state_dict(), "batches": done}, f)
                os.replace(state_path + ".tmp", state_path)
                print(f"batch {done}", flush=True)
                if done == args.batches:
                    loader.close()
                    return
    loader.close()


if __name__ == "__main__":
    main()
