"""Transforms used by tests in several processes (importable by torchrun scripts)."""

from __future__ import annotations

import random

import numpy as np
import torch


def noisy_crop(sample: dict, generator: torch.Generator) -> dict:
    """Draws from its generator AND from every global RNG, which the Loader seeds per sample."""
    data = torch.frombuffer(bytearray(sample["data"]), dtype=torch.uint8)
    start = int(torch.randint(0, data.numel() - 8, (1,), generator=generator))
    crop = data[start:start + 8].to(torch.int16)
    crop = crop + torch.randint(0, 3, (8,)) + int(np.random.randint(0, 3)) + random.randint(0, 2)
    return {"crop": crop, "label": sample["label"]}


def make_samples(n: int, seed: int = 0):
    """Samples with random-length byte payloads and a label."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        size = int(rng.integers(16, 96))
        yield {"data": rng.integers(0, 256, size, dtype=np.uint8).tobytes(), "label": i % 7}
