"""A mixture's order: which source each position of an epoch draws, and which of its samples.

Pure functions of (sources' sizes, weights, seed, epoch, position), numpy only. Three parts:

1. **Interleave** (`order.interleave`): position q of an epoch draws the source that stride
   scheduling by the weights puts there. The interleave restarts at each epoch's start, so
   every epoch (of one set of weights) has the same per-source counts, and it does not depend
   on the seed.
2. **Passes**: each source's draws are numbered from the first epoch on, and draw d of a source
   of n samples reads sample `perm_pass(d mod n)` of pass `d div n`, where `perm_pass` is a
   Feistel permutation of range(n) keyed by (seed, source name, pass) (`order.permute`; the
   identity without shuffle). A source that the weights draw more often than it has samples
   starts a new pass, newly permuted, when its pass ends; a large one continues its pass in the
   next epoch. Within a pass no sample is read twice.
3. **Segments**: weights hold from a point (epoch, position) on. A `Segment` records where it
   starts, its weights, each source's draws before it and the epoch length while it holds.
   One segment is the whole history of a run that never changed its weights; a resume with new
   weights (or a new source) adds one at the resume point whose draws are where each source's
   pass stood (`MixtureOrder.load_order_state`), so every source continues its pass and nothing
   this pass used is read again. The segments that start before the current epoch are replaced
   by the one in effect at its start, so the state stays O(sources) plus one entry per change
   of weights within the epoch.

Cost: `samples_at` is O(S log S) per position (S sources) for any position set, vectorised,
with O(1) memory per position: the Loader computes it in its workers for any (epoch, position),
so a resume is exact in O(S) under any number of workers or world size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.order.interleave import interleave, position_of_draw
from shardloader.order.keys import TAG_MIXTURE, derive_key, derive_keys
from shardloader.order.permute import feistel_permute

#: The mixture order's algorithm version: a state of another version is refused.
MIXTURE_ORDER_VERSION = 1
STATE_FORMAT = "shardloader-mixture-order"


def name_key(name: str) -> int:
    """A stable 64-bit number for a source's name (its passes' keys; no Python hash seed)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def pass_length(names: list[str], sizes: list[int], weights: list[float], name: str) -> int:
    """Positions of an epoch that is one pass of source `name`: up to and including its
    `size`-th draw under `weights`."""
    if name not in names:
        raise ValueError(f"epoch={name!r}: no source of that name (sources: {', '.join(names)})")
    i = names.index(name)
    if weights[i] <= 0:
        raise ValueError(f"epoch={name!r}: that source has weight 0, so it would never end an epoch")
    return position_of_draw(np.asarray(weights, dtype=np.float64), i, sizes[i] - 1) + 1


@dataclass(frozen=True)
class Segment:
    """Weights that hold from (epoch, position) on: by source name, in tie order (the source
    listed first draws first at equal times); `draws`: each source's draws before it (counted
    from the first epoch); `length`: the epoch length while it holds."""

    epoch: int
    position: int
    weights: dict[str, float]
    draws: dict[str, int]
    length: int

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "weights": dict(self.weights),
                "draws": dict(self.draws), "length": self.length}

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> Segment:
        try:
            return cls(int(entry["epoch"]), int(entry["position"]),
                       {str(k): float(v) for k, v in entry["weights"].items()},
                       {str(k): int(v) for k, v in entry["draws"].items()}, int(entry["length"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"mixture order state: a segment is malformed ({e!r}): {entry!r}") from None


class MixtureOrder:
    """The PureSampler of a mixture (see `shardloader.loader.protocol`): global sample
    `offsets[i] + local` for source i's local sample, at any (seed, epoch, positions).

    `names`, `sizes`: the sources, in the mixture's order (global index = offset + local);
    `weights`: by source, this run's; `length`: positions per epoch; `identity`: the sources'
    identities and lengths (the fingerprint, which the weights are not part of)."""

    def __init__(self, names: list[str], sizes: list[int], weights: list[float], length: int, *,
                 shuffle: bool = True, identity: str = "") -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"mixture: source names must be distinct; got {names}")
        self.names = list(names)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.weights = dict(zip(self.names, map(float, weights), strict=True))
        self.length = int(length)
        self.shuffle = bool(shuffle)
        self.fingerprint = f"mixture-order v{MIXTURE_ORDER_VERSION} [{identity}]"
        self.segments = [Segment(0, 0, dict(self.weights), dict.fromkeys(self.names, 0), self.length)]
        self._index = {name: i for i, name in enumerate(self.names)}
        self._name_keys = [name_key(name) for name in self.names]

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"MixtureOrder({self.weights}, length={self.length}, shuffle={self.shuffle})"

    # -- the sequence -------------------------------------------------------------------------
    def samples_at(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Global sample indices (int64) at `positions` of `epoch`."""
        positions = np.asarray(positions, dtype=np.int64)
        source, draw = self.draws_at(epoch, positions.ravel())
        local = np.empty_like(draw)
        for i in np.unique(source).tolist():
            mine = source == i
            n = int(self.sizes[i])
            passes, at = np.divmod(draw[mine], n)
            if self.shuffle:
                base = derive_key(seed, TAG_MIXTURE, self._name_keys[i])
                for number in np.unique(passes).tolist():  # one key per pass (a block holds one or two)
                    same = passes == number
                    key = derive_keys(base, np.array([number], dtype=np.uint64))[0]
                    at[same] = feistel_permute(at[same], n, key)
            local[mine] = at
        return (self.offsets[source] + local).reshape(positions.shape)

    def draws_at(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source drawn at each position, that draw's number among the source's draws since
        the first epoch), both int64."""
        positions = np.asarray(positions, dtype=np.int64)
        which = self._segment_of(epoch, positions)
        source = np.empty(positions.size, dtype=np.int64)
        draw = np.empty(positions.size, dtype=np.int64)
        for s in np.unique(which).tolist():
            mine = which == s
            base, q, to_mine = self._segment_base(self.segments[s], epoch, positions[mine])
            counts, drawn = interleave(self._weights_of(self.segments[s]), q)
            source[mine] = to_mine[drawn]
            draw[mine] = base[drawn] + counts[np.arange(drawn.size), drawn]
        return source, draw

    def draws_before(self, epoch: int, position: int) -> dict[str, int]:
        """Each source's draws before (epoch, position), counted from the first epoch."""
        segment = self.segments[int(self._segment_of(epoch, np.array([position]))[0])]
        base, q, to_mine = self._segment_base(segment, epoch, np.array([position]))
        counts, _ = interleave(self._weights_of(segment), q)
        total = base + counts[0]
        order = list(segment.weights)
        out = dict.fromkeys(self.names, 0)
        out.update({order[j]: int(total[j]) for j in range(len(order))})
        return out

    def _segment_of(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Per position: the index of the segment in effect there."""
        first = self.segments[0]
        if epoch < first.epoch or (epoch == first.epoch and positions.size and positions.min() < first.position):
            raise ValueError(
                f"mixture order: epoch {epoch} position {positions.min() if positions.size else 0} "
                f"is before this order's history, which starts at epoch {first.epoch} position "
                f"{first.position} (the state it was resumed from keeps the current epoch only)")
        which = np.zeros(positions.size, dtype=np.int64)
        for s, segment in enumerate(self.segments[1:], 1):
            if segment.epoch < epoch:
                which[:] = s
            elif segment.epoch == epoch:
                which[positions >= segment.position] = s
        return which

    def _weights_of(self, segment: Segment) -> np.ndarray:
        return np.asarray(list(segment.weights.values()), dtype=np.float64)

    def _segment_base(self, segment: Segment, epoch: int,
                      positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(draws before the interleave restarted, in the segment's source order; the positions
        within the restarted interleave; the segment's source order as this order's indices)."""
        order = list(segment.weights)
        base = np.asarray([segment.draws.get(name, 0) for name in order], dtype=np.int64)
        to_mine = np.asarray([self._index[name] for name in order], dtype=np.int64)
        if epoch == segment.epoch:
            return base, positions - segment.position, to_mine
        weights = self._weights_of(segment)
        rest, full = interleave(weights, np.array([segment.length - segment.position, segment.length]))[0]
        return base + rest + (epoch - segment.epoch - 1) * full, positions, to_mine

    # -- state (optional PureSampler members) ------------------------------------------------
    def order_state(self, epoch: int, position: int) -> dict[str, Any]:
        """Plain dict: where each source's pass stands at (epoch, position), and the weight
        segments that make the sequence of this epoch (O(sources) unless weights changed
        within the epoch)."""
        draws = self.draws_before(epoch, position)
        sizes = dict(zip(self.names, self.sizes.tolist(), strict=True))
        first = int(self._segment_of(epoch, np.array([0]))[0])
        return {
            "format": STATE_FORMAT, "version": MIXTURE_ORDER_VERSION,
            "sources": {name: {"size": sizes[name], "draws": d, "pass": d // sizes[name],
                               "in_pass": d % sizes[name]} for name, d in draws.items()},
            "segments": [s.to_dict() for s in self.segments[first:]],
        }

    def load_order_state(self, state: dict[str, Any], epoch: int, position: int) -> None:
        """Continue from `state` (this order's `order_state`, saved at (epoch, position)) with
        this order's weights: when they differ from the saved ones (or a source was added), a
        new segment starts at (epoch, position) where each source's pass stood."""
        segments = self._check_state(state)
        self.segments = segments
        draws = self.draws_before(epoch, position)
        last = segments[-1]
        if list(last.weights.items()) == list(self.weights.items()) and last.length == self.length:
            return  # the same weights, sources and epoch length: the saved sequence goes on
        keep = [s for s in segments if (s.epoch, s.position) < (epoch, position)]
        self.segments = keep + [Segment(epoch, position, dict(self.weights), draws, self.length)]

    def _check_state(self, state: Any) -> list[Segment]:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"mixture order state: not a {STATE_FORMAT} dict: {str(state)[:200]}")
        if state.get("version") != MIXTURE_ORDER_VERSION:
            raise ValueError(f"mixture order state: version {state.get('version')!r}, this release "
                             f"reads version {MIXTURE_ORDER_VERSION}")
        saved = state.get("sources")
        if not isinstance(saved, dict):
            raise ValueError("mixture order state: 'sources' must be a dict by source name")
        sizes = dict(zip(self.names, self.sizes.tolist(), strict=True))
        for name, entry in saved.items():
            if name not in sizes:
                raise ValueError(
                    f"mixture source {name!r}: in the saved state but not in this mixture; keep it "
                    f"with weight 0 to stop reading it (its pass is then kept for later)")
            if int(entry["size"]) != sizes[name]:
                raise ValueError(f"mixture source {name!r}: the saved state has {entry['size']} "
                                 f"samples, this mixture {sizes[name]}; its passes would name "
                                 f"other samples")
        segments = [Segment.from_dict(entry) for entry in state.get("segments") or []]
        if not segments:
            raise ValueError("mixture order state: no segments")
        return segments
