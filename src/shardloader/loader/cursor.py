"""`Cursor`: where a Loader is — the epoch, the global positions consumed in it, and the flags
of the epoch contract (see `Loader`) — the one thing an epoch iterator advances.

The cursor is the Loader's whole resumable state (`state_dict()` is its epoch and position
plus the fingerprint). Its `generation` changes whenever the cursor is moved from outside an
iteration (`set_epoch`, `load_state_dict`, a new `iter()`, `close()`), which makes every
iterator handed out before it stale.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Cursor:
    """An epoch of `length` global positions, consumed `global_batch_size` at a time."""

    length: int
    global_batch_size: int
    epoch: int = 0
    position: int = 0  # global positions consumed in the current epoch
    restored: bool = False  # loaded from a state and not iterated since (see Loader.set_epoch)
    hold: bool = False  # set_epoch(e) at the end of epoch e: the next iter() yields nothing
    generation: int = 0
    last_batch: tuple[int, int] | None = None  # (epoch, step) of the last batch delivered

    @property
    def epoch_finished(self) -> bool:
        return self.position >= self.length

    @property
    def next_epoch(self) -> int:
        """The epoch the next batch comes from: this one, or the next once this one is over."""
        return self.epoch + 1 if self.epoch_finished else self.epoch

    @property
    def next_step(self) -> int:
        """The step of the current epoch the next batch is (its number of steps at the end)."""
        return -(-self.position // self.global_batch_size)

    def invalidate(self) -> None:
        """Make the iterators handed out so far stale."""
        self.generation += 1

    def move_to(self, epoch: int) -> None:
        """Start `epoch` at its first batch."""
        self.epoch, self.position = epoch, 0
        self.restored = self.hold = False
        self.invalidate()

    def hold_if_finished(self) -> None:
        """`set_epoch` to the current epoch: at its end, iterating it again yields nothing."""
        self.hold = self.epoch_finished

    def restore(self, epoch: int, position: int) -> None:
        """Continue at a saved (epoch, position)."""
        self.epoch, self.position = epoch, position
        self.restored, self.hold = True, False
        self.invalidate()

    def begin_iteration(self) -> None:
        """A new `iter()` (then `ready_epoch`): the iterators before it are stale."""
        self.invalidate()
        self.restored = False

    def ready_epoch(self) -> bool:
        """Make the epoch to iterate current and say whether it has batches left: at an epoch's
        end, that is the next epoch (from its start) unless the cursor holds this one."""
        if self.epoch_finished:
            if self.hold:  # set_epoch(e) at the end of epoch e: nothing of it is left
                self.hold = False
                return False
            self.epoch, self.position = self.epoch + 1, 0
        self.hold = False
        return True

    def advance(self, step: int) -> None:
        """The batch of `step` of the current epoch was delivered."""
        self.position = min((step + 1) * self.global_batch_size, self.length)
        self.last_batch = (self.epoch, step)
