"""`pin_batch`: a delivered batch in page-locked memory, for `Loader(pin_memory=True)`.

Pinned host memory lets the training step's `tensor.to("cuda", non_blocking=True)` copy
asynchronously. The Loader pins in the training process as it delivers each batch, so worker
processes never touch CUDA.
"""

from __future__ import annotations

from typing import Any

import torch


def pin_batch(batch: Any) -> Any:
    """Pin every tensor in a (nested) batch; a no-op without CUDA."""
    if not torch.cuda.is_available():
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: pin_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(pin_batch(v) for v in batch)
    return batch
