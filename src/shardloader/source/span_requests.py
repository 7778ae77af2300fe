"""How the spans a read by range needs become requests (`shardloader.source.ranged`): spans of
one shard that lie close together share a request, because on object stores a request costs
far more than a few kB of transfer.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

#: Spans of one shard at most this far apart are fetched in one request: 1 MiB, the distance
#: below which the Rust `object_store` crate (behind obstore, litdata's reader) joins ranges
#: too. On loopback moto a cold first batch of 64 rows from 8 shards took 60 requests with
#: 64 KiB and 35 with 1 MiB (10 MB instead of 1 MB): 0.45 -> 0.38 s to the first batch, A/B.
#: Behind a proxy adding 30 ms per request: 0.47 -> 0.34 s at 200 MB/s, but 0.49 -> 0.68 s at
#: 25 MB/s, where the gaps' bytes cost more than the requests they save (see docs/cache.md).
DEFAULT_GAP = 1 << 20
#: One request covers at most this many bytes (spans are never split).
MAX_REQUEST = 8 << 20


def coalesce(spans: np.ndarray, gap: int) -> list[tuple[int, int, list[int]]]:
    """Requests (lo, hi, span positions) covering `spans` (int64 [n, 2] offset, length), each
    joining spans at most `gap` bytes apart, up to `MAX_REQUEST` bytes."""
    order = np.argsort(spans[:, 0], kind="stable")
    out: list[tuple[int, int, list[int]]] = []
    for i in order.tolist():
        lo, n = spans[i].tolist()
        hi = lo + n
        if out and lo - out[-1][1] <= gap and max(hi, out[-1][1]) - out[-1][0] <= MAX_REQUEST:
            prev = out[-1]
            out[-1] = (prev[0], max(prev[1], hi), prev[2] + [i])
        else:
            out.append((lo, hi, [i]))
    return out


def request_cost(spans: np.ndarray, gap: int) -> int:
    """Bytes the requests for `spans` transfer when joined `gap` apart (gaps' bytes included)."""
    return sum(hi - lo for lo, hi, _ in coalesce(spans, gap)) if len(spans) else 0


def gaps_by_cost(spans: np.ndarray, max_gap: int) -> Iterator[tuple[int, int]]:
    """(gap, bytes) for each way of joining `spans` worth trying, fewest requests first: `max_gap`,
    then each smaller distance between neighbouring spans, down to 0 (the spans alone); each
    one's bytes computed only when it is reached. A reader with a byte budget takes the first
    that fits: the fewest requests within it (most reads fit at `max_gap` and compute one
    joining, as when the budget offered no choice). (Trying only
    `max_gap` and 0, a first batch whose joined requests passed a quarter of each shard went from
    29 requests to 53 on loopback moto, 0.23 -> 0.61 s for its spans.)"""
    if not len(spans):
        yield max_gap, 0
        return
    ordered = spans[np.argsort(spans[:, 0], kind="stable")]
    ends = np.maximum.accumulate(ordered[:, 0] + ordered[:, 1])
    distances = np.maximum(ordered[1:, 0] - ends[:-1], 0)
    for gap in sorted({max_gap, 0, *(int(d) for d in distances if d < max_gap)}, reverse=True):
        yield gap, request_cost(spans, gap)
