"""Resume cost and memory of the Loader's order for 10^4 .. 10^8 samples (index only, no data).

Measures the time from `load_state_dict` to the first batch's sample indices at positions near
the end of an epoch, and the RSS the loader adds for a 10^8-sample index. Goal: flat in N.
Peer figure for context (design.md): a peer that materialises an O(N) permutation per epoch
spends minutes resuming at 10^8 samples; torch's DataLoader + sampler replays nothing but also
cannot skip, so resume there means iterating the sampler to the position (O(position)).

Run: .venv/bin/python benchmarks/resume_cost.py
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks._common import machine, rss_bytes, table
from shardloader.format.index import Index, ShardInfo
from shardloader.loader import Loader

SAMPLES_PER_SHARD = 10_000


class IndexOnlyDataset:
    """Just an index: enough for the Loader to compute order and state, no data."""

    def __init__(self, num_samples: int) -> None:
        shards, rest = divmod(num_samples, SAMPLES_PER_SHARD)
        sizes = [SAMPLES_PER_SHARD] * shards + ([rest] if rest else [])
        self.index = Index(
            schema={"image": "binary"},
            shards=tuple(ShardInfo(f"s{i:06d}.arrow", "arrow", n, n * 1000, "xxh3_128:" + "0" * 32)
                         for i, n in enumerate(sizes)),
        )
        self.source = None

    def __len__(self) -> int:
        return self.index.num_samples

    def get_many(self, samples):  # the Loader's native interface; this benchmark reads no data
        raise NotImplementedError("an index-only dataset holds no samples")


def resume_seconds(dataset: IndexOnlyDataset, batch: int = 256, repeats: int = 5) -> float:
    reference = Loader(dataset, batch_size=batch, seed=1, shuffle=True)
    steps = len(reference)
    state = {**reference.state_dict(), "epoch": 3, "position": (steps - 2) * batch}
    times = []
    for _ in range(repeats):
        loader = Loader(dataset, batch_size=batch, seed=1, shuffle=True)
        start = time.perf_counter()
        loader.load_state_dict(state)
        samples = loader.step_samples(3, steps - 2)
        times.append(time.perf_counter() - start)
        assert samples.size == batch
    return statistics.median(times)


def sampler_skip_seconds(num_samples: int, batch: int = 256) -> float:
    """What resuming costs with torch's RandomSampler: draw the permutation, skip to the end."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_samples, generator=generator)
    _ = perm[num_samples - 2 * batch: num_samples - batch]
    return time.perf_counter() - start


def memory_line() -> str:
    """Measured first, in a fresh process, so freed memory of other runs cannot hide growth."""
    before = rss_bytes()
    dataset = IndexOnlyDataset(10**8)
    loader = Loader(dataset, batch_size=256, seed=1, shuffle=True)
    loader.step_samples(0, len(loader) - 1)
    after = rss_bytes()
    return (f"RSS added by a 10^8-sample index + loader + order: {(after - before) / 2**20:.1f} MiB "
            f"({dataset.index.num_shards} shards of {SAMPLES_PER_SHARD} samples)")


def main() -> None:
    memory = memory_line()
    rows = []
    for exponent in (4, 5, 6, 7, 8):
        n = 10**exponent
        dataset = IndexOnlyDataset(n)
        ours = resume_seconds(dataset)
        peer = sampler_skip_seconds(n) if exponent <= 8 else float("nan")
        rows.append([f"10^{exponent}", dataset.index.num_shards, ours * 1e3, peer * 1e3, peer / ours])
        del dataset
        gc.collect()
    print(f"# Resume cost (machine: {machine()})\n")
    print(table(["samples", "shards", "shardloader resume ms", "randperm+skip ms", "ratio"], rows))
    print("\n" + memory)


if __name__ == "__main__":
    main()
