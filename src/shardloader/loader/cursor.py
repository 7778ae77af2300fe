"""`Cursor`: where a Loader is — the epoch, the global positions consumed in it, and whether it
was just restored — the one thing an epoch iterator advances.

The cursor is the Loader's whole resumable state (`state_dict()` is its epoch and position
plus the fingerprint). The epoch contract it keeps (see `Loader`):

- a new iteration starts the cursor's epoch from its beginning (`start_iteration`), except the
  first one after `restore`, which continues at the restored position;
- delivering a batch advances the position (`advance`); the epoch itself advances only when
  an iteration over it ends (`finish_epoch`, on StopIteration), so a state saved on an
  epoch's last batch is still that epoch, at its end.

Its `generation` changes whenever the cursor is moved from outside an iteration (`set_epoch`,
`load_state_dict`, a new `iter()`, `close()`), which makes every started iterator stale. An
iterator not started yet follows such moves (trainers call `iter()`, then `set_epoch` or
`load_state_dict`, then `next()`): only a newer `iter()` or `close()` (`iterations`) makes it
stale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardloader.errors import StateError


@dataclass
class Cursor:
    """An epoch of `length` global positions, consumed `global_batch_size` at a time."""

    length: int
    global_batch_size: int
    epoch: int = 0
    position: int = 0  # global positions consumed in the current epoch
    restored: bool = False  # loaded from a state and not iterated since (see Loader.set_epoch)
    generation: int = 0
    iterations: int = 0  # bumped by each iter() and close(): iterators not started go stale only then
    last_batch: tuple[int, int] | None = None  # (epoch, step) of the last batch delivered
    #: The dataset's `state_dict()` as the process that made the last delivered batch left it
    #: (a dataset with a state; see `shardloader.loader.dataset_state`), else None.
    dataset_state: Any = None

    @property
    def epoch_finished(self) -> bool:
        """Every batch of the current epoch was delivered (its iteration may not have ended)."""
        return self.position >= self.length

    @property
    def next_step(self) -> int:
        """The step of the current epoch the next batch is (its number of steps at the end)."""
        return -(-self.position // self.global_batch_size)

    @property
    def next_start(self) -> tuple[int, int]:
        """(epoch, step) where the next iteration starts: the restored step right after
        `restore`, else the current epoch's first (see `start_iteration`)."""
        return self.epoch, self.next_step if self.restored else 0

    def invalidate(self) -> int:
        """Make the iterators handed out so far stale; the new generation."""
        self.generation += 1
        return self.generation

    def move_to(self, epoch: int) -> None:
        """Start `epoch` at its first batch."""
        self.epoch, self.position = epoch, 0
        self.restored = False
        self.invalidate()

    def restore(self, epoch: int, position: int) -> None:
        """Continue at a saved (epoch, position) with the next iteration."""
        self.epoch, self.position = epoch, position
        self.restored = True
        self.invalidate()

    def start_iteration(self) -> None:
        """An iteration begins: at the restored position right after `restore`, else at the
        start of the current epoch."""
        if not self.restored:
            self.position = 0
        self.restored = False

    def advance(self, step: int) -> None:
        """The batch of `step` of the current epoch was delivered (or failed, and was reported
        to the caller in its place: it is consumed either way)."""
        self.position = min((step + 1) * self.global_batch_size, self.length)
        self.last_batch = (self.epoch, step)

    def finish_epoch(self) -> None:
        """The iteration over the current epoch ended: the next epoch is current, at its start."""
        self.epoch, self.position = self.epoch + 1, 0
        self.restored = False


def check_position(cursor: Cursor, position: int) -> None:
    """A saved position must be a step boundary of the cursor's epoch (or its end)."""
    length, per_step = cursor.length, cursor.global_batch_size
    if position > length or position % per_step and position != length:
        raise StateError(f"loader state position {position} is not a step boundary of an epoch of "
                         f"{length} positions with global batch size {per_step}")


def check_move(cursor: Cursor, epoch: int) -> None:
    """Refuse a `set_epoch(epoch)` that would replay data, or skip data of a restored
    cursor (StateError saying which loop to write; see `Loader.set_epoch`)."""
    where = (f"epoch {cursor.epoch} at position {cursor.position} of {cursor.length}"
             + (", restored from a saved state" if cursor.restored else ""))
    loop = (f"start the epoch loop at the loader's epoch: `for epoch in range(loader.epoch, "
            f"epochs): loader.set_epoch(epoch)` (loader.epoch is {cursor.epoch}, the epoch to "
            f"run next)")
    if epoch < cursor.epoch:
        raise StateError(
            f"set_epoch({epoch}) would move this loader back from {where} and replay data; "
            f"{loop}. To replay on purpose, call set_epoch({epoch}, force=True)."
        )
    if cursor.restored and not (cursor.epoch_finished and epoch == cursor.epoch + 1):
        skipped = (f"the rest of epoch {cursor.epoch}" if not cursor.epoch_finished
                   else f"epochs {cursor.epoch + 1}..{epoch - 1}")
        raise StateError(
            f"set_epoch({epoch}) would skip {skipped}: this loader is at {where}; {loop}. "
            f"To skip on purpose, call set_epoch({epoch}, force=True)."
        )


def check_iterator(iterator: Any, unit: str) -> None:
    """What each `next()` of an epoch iterator (`epoch.EpochIterator`, the iterable dataset's
    `iterable_pass.IterablePass`) checks first: StopIteration once it ended; RuntimeError once it
    broke (restart the `unit`, or load a state) or went stale (a newer `iter()`, a reload or a
    `close()`). One not started yet follows the cursor's moves (`set_epoch`, `load_state_dict`)."""
    if iterator.ended:
        raise StopIteration
    if iterator.broken is not None:
        raise RuntimeError(f"this iterator cannot go on: {iterator.broken}; iterate the loader again "
                           f"(iter(loader)) to restart the {unit}, or load a saved state")
    if iterator.generation != iterator.cursor.generation:
        if iterator.started or iterator.iteration != iterator.cursor.iterations:
            raise RuntimeError("this iterator is stale: the loader was re-iterated, reloaded or closed")
        iterator.generation = iterator.cursor.generation
