"""A training process over an iterable dataset, for the kill-and-resume tests
(tests/test_iterable.py, tests/test_iterable_hf.py).

    python -m tests.iterable_train OUT DATASET NUM_WORKERS EPOCHS [PAUSE_AT]

DATASET is "stateful" (`iterable_datasets.Stateful(20)`) or "hf:DIR" (a Hugging Face streaming
dataset of DIR's *.jsonl files). After each batch it writes OUT/step-NNNNN.json atomically:
the batch's bytes and the loader's state after it (a checkpoint), then prints "step N". On
start it resumes from the newest step file in OUT, if any: a run killed at any instant and
started again writes exactly the step files an uninterrupted run writes. With PAUSE_AT, it
waits for a line on stdin after step PAUSE_AT (its workers running ahead meanwhile): the kill
test kills it there, mid-epoch, at a known step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import shardloader
from tests import iterable_datasets as ids


def describe(value: Any) -> Any:
    """A batch as plain values, its tensors as dtype, shape and the hex of their bytes."""
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), list(value.shape), value.contiguous().numpy().tobytes().hex()]
    if isinstance(value, dict):
        return {str(key): describe(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    return value


def make_dataset(spec: str) -> Any:
    if spec == "stateful":
        return ids.Stateful(20)
    if spec.startswith("hf:"):
        return ids.hf_stream("json", sorted(str(p) for p in Path(spec[3:]).glob("*.jsonl")))
    raise ValueError(f"unknown dataset {spec!r}")


def main(out: str, spec: str, num_workers: int, epochs: int, pause_at: int | None) -> None:
    root = Path(out)
    loader = shardloader.Loader(make_dataset(spec), batch_size=3, num_workers=num_workers)
    done = sorted(root.glob("step-*.json"))
    step = 0
    if done:
        last = json.loads(done[-1].read_text())
        loader.load_state_dict(last["state"])
        step = last["step"]
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            step += 1
            record = {"step": step, "epoch": epoch, "batch": describe(batch),
                      "state": loader.state_dict()}
            tmp = root / f".step-{step:05d}.tmp"
            tmp.write_text(json.dumps(record))
            os.replace(tmp, root / f"step-{step:05d}.json")
            print(f"step {step}", flush=True)
            if step == pause_at:
                sys.stdin.readline()
    loader.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
         int(sys.argv[5]) if len(sys.argv) > 5 else None)
