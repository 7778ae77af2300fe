"""Which processes take part in a checkpoint, and how they agree: one process, or every rank.

`LocalGroup` is a world of one (every agreement is trivial); `DistGroup` coordinates the ranks
of a torch.distributed job without touching the training process group:

- Two gloo groups made at construction: `ctl`, used only from the training thread (agreeing on
  skips, staging errors, which checkpoint to load), and `bg`, used only by the writer thread
  (DCP's planning, gathering every rank's files to rank 0, broadcasting the outcome).
- `enter(op)`: every collective call (construction, `save`, `load`) first checks in through the
  job's rendezvous store, with a bounded wait. A call made on some ranks only (the usual
  `if rank == 0: ckpt.save(...)`) is then a clear error naming the call and the missing ranks
  (after a warning at `warn_after` seconds), instead of a gloo hang that ends in "connection
  closed by peer" when the other rank exits. Ranks in different calls, and a rank that closed
  its checkpointer, are reported as soon as they are seen.
"""

from __future__ import annotations

import itertools
import logging
import time
from datetime import timedelta
from typing import Any

import torch

from shardloader.errors import CheckpointError
from shardloader.runtime import distenv

log = logging.getLogger(__name__)

_instances = itertools.count()
_POLL_MAX_S = 0.05
_SCAN_AFTER_S = 1.0  # look for ranks in another call or closed once a wait lasts this long


class LocalGroup:
    """One process: every collective is the identity."""

    rank = 0
    world_size = 1
    bg = None
    ctl = None

    def enter(self, op: str) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def any(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        pass

    def bg_gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def bg_broadcast(self, obj: Any) -> Any:
        return obj

    def close(self) -> None:
        pass


class DistGroup:
    """The ranks of an initialised torch.distributed job (construction is collective)."""

    def __init__(self, *, timeout: timedelta, what: str) -> None:
        if not distenv.process_group_active():
            raise CheckpointError("distributed checkpointing needs an initialised process group")
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world_size = distenv.rank_and_world()
        self.timeout_s = timeout.total_seconds()
        self.warn_after_s = min(30.0, self.timeout_s / 2)
        self._store = _default_store()
        self._prefix = f"shardloader/checkpointer/{next(_instances)}"
        self._ops = 0
        self._last_op = "none"
        self._history: list[str] = []  # keys of the last ops passed, deleted two ops later
        self._broken: str | None = None
        self.enter(what)
        self.ctl = dist.new_group(backend="gloo", timeout=timeout)
        self.bg = dist.new_group(backend="gloo", timeout=timeout)

    # -- arrival check ----------------------------------------------------------------------
    def enter(self, op: str) -> None:
        """Wait (bounded) until every rank made this same collective call; raise otherwise."""
        if self._broken is not None:
            raise CheckpointError(f"{op}: this checkpointer is unusable after an earlier "
                                  f"collective call failed: {self._broken}")
        if self._store is None:
            return
        n = self._ops
        self._ops += 1
        # The op is part of the key: ranks in different calls never complete each other's count.
        store, key = self._store, f"{self._prefix}/op/{n}/{op}"
        store.set(f"{self._prefix}/at/{self.rank}", f"{n}\n{op}")
        if store.add(f"{key}/count", 1) == self.world_size:
            store.set(f"{key}/done", "1")
        t0 = time.monotonic()
        poll, warned, scanned = 0.001, False, t0
        while not store.check([f"{key}/done"]):
            waited = time.monotonic() - t0
            if time.monotonic() - scanned >= _SCAN_AFTER_S:
                scanned = time.monotonic()
                self._scan(op, n)
            if waited >= self.timeout_s:
                self._fail(op, self._absent_message(op, n, waited))
            if not warned and waited >= self.warn_after_s:
                warned = True
                log.warning("rank %d has waited %.0f s in %s for %s; %s", self.rank, waited, op,
                            self._absent(n), _collective_hint(op))
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX_S)
        self._history.append(key)
        old = self._history.pop(0) if len(self._history) > 2 else None
        if old is not None and self.rank == 0:  # every rank is past the op before last
            try:
                for suffix in ("count", "done"):
                    store.delete_key(f"{old}/{suffix}")
            except Exception as exc:  # a store without deletion: the keys are small
                log.debug("could not delete arrival keys: %r", exc)
        self._last_op = op

    def _scan(self, op: str, n: int) -> None:
        """Raise at once when another rank closed, or is in another call at the same point."""
        for r in range(self.world_size):
            if r == self.rank:
                continue
            at = self._at(r)
            closed = self._store.check([f"{self._prefix}/closed/{r}"])
            if closed and (at is None or at[0] < n):
                self._fail(op, f"rank {r} closed its Checkpointer without calling {op}; "
                               f"{_collective_hint(op)}")
            if at is not None and at[0] == n and at[1] != op:
                self._fail(op, f"rank {r} called {at[1]} while rank {self.rank} called {op}; "
                               f"{_collective_hint(op)}")

    def _at(self, r: int) -> tuple[int, str] | None:
        key = f"{self._prefix}/at/{r}"
        if not self._store.check([key]):
            return None
        n, _, op = self._store.get(key).decode().partition("\n")
        return int(n), op

    def _absent(self, n: int) -> str:
        missing = []
        for r in range(self.world_size):
            at = self._at(r) if r != self.rank else (n, "")
            if at is None or at[0] < n:
                last = "none" if at is None else at[1]
                missing.append(f"rank {r} (its last checkpointer call: {last})")
        return ", ".join(missing) or "no rank (they arrived meanwhile)"

    def _absent_message(self, op: str, n: int, waited: float) -> str:
        return (f"{op} waited {waited:.0f} s on rank {self.rank} for {self._absent(n)}; "
                f"{_collective_hint(op)}")

    def _fail(self, op: str, message: str) -> None:
        self._broken = message
        raise CheckpointError(message)

    # -- collectives (gloo) -----------------------------------------------------------------
    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.ctl)
        return out

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.ctl)
        return bool(t.item())

    def barrier(self) -> None:
        self._dist.barrier(group=self.ctl)

    def bg_gather(self, obj: Any) -> list[Any] | None:
        """Writer thread: every rank's `obj` on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=0, group=self.bg)
        return out

    def bg_broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.bg)
        return box[0]

    def close(self) -> None:
        """Tell the other ranks (waiting in `enter`) that this rank will call nothing more."""
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/closed/{self.rank}", self._last_op)
            except Exception as exc:  # the job's store may be gone at the very end of a run
                log.debug("could not mark rank %d closed: %r", self.rank, exc)


def _collective_hint(op: str) -> str:
    call = op.split("(", 1)[0]
    return (f"{call} is collective under torch.distributed: call it on every rank, at the same "
            "point and with the same arguments (not only inside `if rank == 0:`)")


def _default_store() -> Any:
    """The default process group's rendezvous store, or None where torch hides it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as exc:
        log.debug("no rendezvous store for checkpoint arrival checks: %r", exc)
        return None


def make_group(distributed: bool | None, timeout: timedelta, what: str) -> LocalGroup | DistGroup:
    """A DistGroup when asked (default: a process group of world size > 1 is initialised)."""
    if distributed is None:
        distributed = distenv.rank_and_world()[1] > 1
    return DistGroup(timeout=timeout, what=what) if distributed else LocalGroup()
