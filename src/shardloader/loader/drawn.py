"""`DrawnPlan`: an order drawn from a user's sampler or batch sampler, in the training process,
as DataLoader draws it — for samplers that are not pure functions of (seed, epoch).

Indices are drawn lazily, in step order, as the epoch iterator submits batches (a few batches
ahead of the one handed out, as DataLoader's prefetch draws them), and travel to the workers
inside the tasks. How a resume finds its place again (docs/samplers.md):

- a sampler with `state_dict()`/`load_state_dict()` (StatefulDataLoader's convention: after
  loading a state taken mid-iteration, its next `iter()` continues from there): its state is
  captured right after each batch's indices are drawn, and the state of the batch last handed
  out is what the Loader saves; a resume loads it before the next `iter()`: exact, O(1);
- a sampler whose ITERATOR has them (torchdata's stateful samplers keep their position on
  `iter(sampler)`): the same, with the iterator's state: a resume makes `iter(sampler)` and
  loads the saved state into that iterator;
- any other sampler: fast-forward — `set_epoch(epoch)` when it has one, then the indices (or
  batches) before the saved step are drawn and dropped, with a UserWarning that names the
  sampler and the cost. Exact when the sampler's order depends only on its epoch.

Each iteration calls the sampler's `set_epoch(epoch)` first when it has one (the cursor's
epoch; also a batch sampler's `.sampler`'s), so a DistributedSampler needs no call of its own. Under world size > 1 the sampler is
this rank's (DataLoader's semantics: a DistributedSampler yields this rank's share): its
batches are not split again.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shardloader.loader.protocol import Stateful

#: Steps per epoch of a sampler without len(): the epoch ends when it runs out.
UNKNOWN_STEPS = 1 << 62
#: Drawn batches (and sampler states) kept: a prefetch depth ahead, and the one handed out.
_KEPT = 256


@runtime_checkable
class SetsEpoch(Protocol):
    """A sampler whose order depends on the epoch it is told (DistributedSampler)."""

    def set_epoch(self, epoch: int) -> None: ...


def describe(source: Any) -> str:
    """A user's sampler for messages and the fingerprint: its class, and its len() if any."""
    name = f"{type(source).__module__}.{type(source).__qualname__}"
    try:
        return f"{name} len={len(source)}"
    except TypeError:
        return name


class DrawnPlan:
    """The steps of a user's `source`: a sampler cut into batches of `batch_size` indices
    (the last one short, or dropped with `drop_last`), or, with `batch_size=None`, a batch
    sampler whose every item is one batch."""

    looks_ahead = False  # indices exist only once drawn: no prefetch along them, no workers' plan

    def __init__(self, source: Any, *, batch_size: int | None, drop_last: bool) -> None:
        self.sampler = source
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.stateful = isinstance(source, Stateful)
        self._iterator_stateful = False  # the current iter(sampler) has a state (see begin)
        self._iterator: Iterator[Any] | None = None
        self._at: tuple[int, int] | None = None  # (epoch, step) the next draw is
        self._drawn: dict[tuple[int, int], tuple[np.ndarray, Any]] = {}
        self._pending: tuple[int, int, Any] | None = None  # a restored (epoch, step, state)
        self._loaded: Any = None  # the sampler state loaded last (saved again until a draw)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        """Steps per epoch (this rank's batches; every rank has as many), or UNKNOWN_STEPS."""
        try:
            size = len(self.sampler)
        except TypeError:
            return UNKNOWN_STEPS
        if self.batch_size is None:
            return size
        return size // self.batch_size if self.drop_last else -(-size // self.batch_size)

    def rank_batches(self) -> int:
        """len(loader): DataLoader's TypeError when the sampler has no len()."""
        steps = self.global_steps
        if steps == UNKNOWN_STEPS:
            raise TypeError(f"the sampler {describe(self.sampler)} has no len(), so neither has "
                            f"this Loader (as DataLoader)")
        return steps

    # -- resume --------------------------------------------------------------------------------
    def saved_state(self, last_batch: tuple[int, int] | None) -> Any:
        """The sampler's state right after the indices of `last_batch` (epoch, step: the batch
        handed out last) were drawn; the state loaded last when none was drawn since; None for
        a sampler without state."""
        entry = self._drawn.get(last_batch) if last_batch is not None else None
        return entry[1] if entry is not None else self._loaded

    def restore(self, epoch: int, step: int, state: Any) -> None:
        """A state was loaded: the next iteration of `epoch` continues at `step`; `state` is
        the sampler's saved state (None: fast-forward)."""
        self._loaded = state  # the sampler's or its iterator's (None: fast-forward)
        self._pending = (epoch, step, self._loaded)
        self._iterator = None
        self._drawn.clear()

    def begin(self, epoch: int, first_step: int) -> None:
        """An iteration over `epoch` begins at `first_step`: set the sampler's epoch, load a
        restored state, iter() it, and fast-forward to `first_step` where no state says where."""
        inner = getattr(self.sampler, "sampler", None)  # a BatchSampler's (Lightning sets both)
        for sampler in (self.sampler, inner):
            if isinstance(sampler, SetsEpoch):
                sampler.set_epoch(epoch)
        pending, self._pending = self._pending, None
        loaded = pending is not None and pending[2] is not None
        if loaded and self.stateful:
            self.sampler.load_state_dict(copy.deepcopy(pending[2]))
        self._drawn.clear()
        self._at = (epoch, first_step)
        at_end = first_step >= self.global_steps
        if at_end and not (loaded and not self.stateful):
            self._iterator = iter(())  # an epoch at its end: nothing to draw
            return
        self._iterator = iter(self.sampler)
        self._iterator_stateful = not self.stateful and isinstance(self._iterator, Stateful)
        if loaded and self._iterator_stateful:  # torchdata's: the state is the iterator's
            self._iterator.load_state_dict(copy.deepcopy(pending[2]))
        elif loaded and not self.stateful:
            loaded = False  # a state neither the sampler nor its iterator can take
        if at_end:  # the state was loaded for the sampler's history (its next iter()) only
            self._iterator = iter(())
            return
        if first_step and not (loaded and (pending[0], pending[1]) == (epoch, first_step)):
            self._fast_forward(epoch, first_step)

    def _fast_forward(self, epoch: int, step: int) -> None:
        skip = step if self.batch_size is None else step * self.batch_size
        unit = "batches" if self.batch_size is None else "indices"
        warnings.warn(
            f"resuming sampler {describe(self.sampler)} at epoch {epoch}, step {step} by fast-forward: "
            f"it has no state_dict()/load_state_dict() and is no PureSampler, so the Loader draws "
            f"and drops the {skip} {unit} before that step (O(position): the cost grows with the "
            f"position), which is exact only if its order depends on nothing but set_epoch(). For "
            f"an O(1) exact resume give it state_dict()/load_state_dict() (StatefulDataLoader's "
            f"convention) or samples_at(seed, epoch, positions) (a PureSampler: docs/samplers.md)",
            UserWarning, stacklevel=2)
        assert self._iterator is not None
        next(itertools.islice(self._iterator, skip, skip), None)

    # -- drawing -------------------------------------------------------------------------------
    def draw(self, epoch: int, step: int, *, inline: bool) -> tuple[np.ndarray, int, int] | None:
        """The next batch's indices (always in the task: workers cannot draw them), 0 padded,
        its size; None when the sampler ran out (the epoch ends)."""
        if self._iterator is None or self._at != (epoch, step):
            raise RuntimeError(f"internal: step {step} of epoch {epoch} drawn out of order (at {self._at})")
        if self.batch_size is None:
            batch = next(self._iterator, None)
            items = None if batch is None else list(batch)
        else:
            items = list(itertools.islice(self._iterator, self.batch_size))
            if not items or (self.drop_last and len(items) < self.batch_size):
                items = None
        if items is None:
            self._iterator = iter(())
            return None
        samples = np.asarray([int(i) for i in items], dtype=np.int64)
        state = (copy.deepcopy(self.sampler.state_dict()) if self.stateful
                 else copy.deepcopy(self._iterator.state_dict()) if self._iterator_stateful else None)
        self._drawn[(epoch, step)] = (samples, state)
        while len(self._drawn) > _KEPT:
            self._drawn.pop(next(iter(self._drawn)))
        self._at = (epoch, step + 1)
        return samples, 0, samples.size

    def samples(self, epoch: int, step: int, rank: int | None = None) -> np.ndarray:
        """The indices drawn for (epoch, step) (this rank's only: other ranks draw their own)."""
        entry = self._drawn.get((epoch, step))
        if entry is None or rank is not None:
            raise ValueError(f"step {step} of epoch {epoch} was not drawn in this process: a user's "
                             f"sampler yields its indices only as it is iterated, and only this rank's")
        return entry[0].copy()

    def order(self, epoch: int) -> Any:
        raise TypeError(f"the order of sampler {describe(self.sampler)} exists only as it is drawn: "
                        f"there is no epoch order to compute")

    def tail_report(self) -> dict[str, int]:
        return {"padded": 0, "dropped": 0}
