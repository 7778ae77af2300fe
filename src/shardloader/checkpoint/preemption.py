"""Preemption notices: save the step in progress, commit it within a deadline, exit "preempted".

Spot machines, Kubernetes and SLURM warn before they kill: SIGTERM (Kubernetes waits
`terminationGracePeriodSeconds`, 30 s by default), or a signal the job names (SLURM's
`--signal=USR1@120`). `Checkpointer(root, preemption=True)` turns such a notice into a saved
step, with the README's loop and one changed condition:

    if ckpt.preempted() or step % save_every == 0:
        ckpt.save(step, model=model, optimizer=opt, loader=loader)

- The signal handler only notes the notice (the first signal's time; a second one changes
  nothing). It never saves: a save would run in the middle of whatever the training thread
  was doing.
- `preempted()` is the check at the end of each step. Under torch.distributed it is
  collective (one all_reduce(MAX) of "a notice came" per step on the checkpointer's own gloo
  group), so every rank answers True at the same step, whether one rank, every rank or the
  torchrun agent (which forwards SIGTERM to every rank) got the signal.
- The `save()` that follows commits that step like any save, after waiting for a save still in
  flight (never lost: it completes first, and this one supersedes it), then waits for the
  commit and exits with `EXIT_PREEMPTED` (75, sysexits' EX_TEMPFAIL: "try again"). A launcher
  or batch script that sees 75 requeues the job, and the next run resumes from that step.
- Everything runs against one deadline, counted from the first signal (on a rank that learned
  of the notice from another, from that moment): `Preemption.deadline`, 25 s by default, inside
  Kubernetes' and torchrun's 30 s. When the step cannot be committed in time (the loop did not
  reach the check, an upload is too slow), a watcher thread ends the process at the deadline
  with `EXIT_PREEMPTED_LOST` (76): the manifest of that save is never written after the
  deadline (`CommitSetup.abandon`), so the previous checkpoint stays the newest and nothing
  half-written is listed; the attempt's ending says so (`preempted_lost`).

Each exit records the attempt's ending in the job account (`preempted_saved` or
`preempted_lost`, with the signal, the step and the seconds it took).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardloader.telemetry.job.endings import PREEMPTED_LOST, PREEMPTED_SAVED, record_ending

log = logging.getLogger(__name__)

#: Exit status after a preemption notice whose step was committed: run the job again.
EXIT_PREEMPTED = 75
#: Exit status after a preemption notice whose step could not be committed in time: the
#: previous checkpoint is the newest; run the job again.
EXIT_PREEMPTED_LOST = 76


@dataclass(frozen=True)
class Preemption:
    """What counts as a preemption notice, and how long a save after one may take.

    signals: the signals that are notices (names or numbers): SIGTERM by default; add the one
        your scheduler sends ahead of time (SLURM `--signal=USR1@120`: "SIGUSR1").
    deadline: seconds from the notice by which the step must be committed, else the process
        exits "preempted, not saved". Leave a margin below the grace your platform gives
        (Kubernetes terminationGracePeriodSeconds, 30 s by default; torchrun waits 30 s before
        it SIGKILLs its ranks).
    """

    signals: tuple[str | int, ...] = ("SIGTERM",)
    deadline: float = 25.0

    def __post_init__(self) -> None:
        if isinstance(self.signals, (str, int)):
            object.__setattr__(self, "signals", (self.signals,))
        if not self.signals:
            raise ValueError("Preemption(signals=...) needs at least one signal")
        for sig in self.signals:
            signal_number(sig)
        if isinstance(self.deadline, bool) or not isinstance(self.deadline, (int, float)) \
                or not self.deadline > 0:
            raise ValueError(f"Preemption(deadline=...) must be a positive number of seconds, "
                             f"got {self.deadline!r}")


def signal_number(sig: str | int) -> signal.Signals:
    """The signal named `sig` ("SIGUSR1", "USR1", 10); a ValueError names an unknown one."""
    try:
        if isinstance(sig, str):
            name = sig.upper()
            return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        return signal.Signals(sig)
    except (KeyError, ValueError):
        raise ValueError(f"Preemption(signals=...): {sig!r} is not a signal") from None


def preemption_config(value: Any) -> Preemption | None:
    """`Checkpointer(preemption=...)`: None/False (off), True (the defaults), a number (the
    deadline in seconds) or a `Preemption`."""
    if value is None or value is False:
        return None
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("Checkpointer(preemption=...) must be made on the main thread: only "
                         "it can install signal handlers")
    if value is True:
        return Preemption()
    if isinstance(value, Preemption):
        return value
    if isinstance(value, (int, float)):
        return Preemption(deadline=float(value))
    raise TypeError(f"preemption must be True, a deadline in seconds or a Preemption, got {value!r}")


class Notice:
    """The preemption notice of this process: the signal handlers, the deadline's clock and
    its watcher thread, and which way the process ends (decided once)."""

    def __init__(self, config: Preemption, on_deadline: Callable[[], None]) -> None:
        self.config = config
        self.pid = os.getpid()
        self.signal_name: str | None = None
        self.started: float | None = None  # time.monotonic() of the notice
        self.agreed = False  # preempted() answered True: the next save is the last
        self.saving: int | None = None  # the step that save commits
        self.repeats = 0  # signals after the first (ignored)
        self._on_deadline = on_deadline
        self._noticed = threading.Event()
        self._closed = threading.Event()
        self._decided: str | None = None
        self._lock = threading.Lock()
        self._previous = {}
        for sig in config.signals:
            number = signal_number(sig)
            self._previous[number] = signal.signal(number, self._handler)
        self._thread = threading.Thread(target=self._watch, name="shardloader-preemption",
                                        daemon=True)
        self._thread.start()

    # -- the handler: notes, never saves ----------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:  # a forked loader worker: the training process saves
            return
        if self.started is not None:
            self.repeats += 1
            return
        self.start(signal.Signals(signum).name)

    def start(self, what: str) -> None:
        """The notice arrived now (a signal, or another rank's notice): start the clock."""
        if self.started is None:
            self.started, self.signal_name = time.monotonic(), what
            self._noticed.set()

    @property
    def requested(self) -> bool:
        return self.started is not None

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def remaining(self) -> float:
        return max(0.0, self.config.deadline - self.elapsed())

    # -- the end: one decision ----------------------------------------------------------------
    def decide(self, how: str) -> bool:
        """Whether this caller decides how the process ends (the first to ask does)."""
        with self._lock:
            if self._decided is not None:
                return False
            self._decided = how
            return True

    def _watch(self) -> None:
        self._noticed.wait()
        while not self._closed.is_set():
            left = self.remaining()
            if left <= 0:
                self._on_deadline()
                return
            self._closed.wait(left)

    def close(self) -> None:
        """Stop the watcher and put the previous signal handlers back (main thread only)."""
        self._closed.set()
        self._noticed.set()
        if threading.current_thread() is threading.main_thread() and os.getpid() == self.pid:
            for number, previous in self._previous.items():
                signal.signal(number, previous if previous is not None else signal.SIG_DFL)


def agree(notice: Notice, group: Any) -> bool:
    """Every rank's answer to "did a notice come?" (collective under torch.distributed)."""
    if notice.agreed:
        return True
    if group.any(notice.requested):
        notice.start("a preemption notice on another rank")  # this rank's clock, if no signal
        notice.agreed = True
    return notice.agreed


def save_and_exit(ckpt: Any, step: int, save: Callable[[], Any]) -> None:
    """The save after `preempted()`: wait for the save in flight, commit this step by the
    deadline, record the ending and exit (75); or exit 76 when the deadline passes first."""
    notice: Notice = ckpt._notice
    notice.saving = step
    inflight = ckpt._inflight
    if inflight is not None and not inflight.wait_done(notice.remaining()):
        end_lost(ckpt, f"the save of step {inflight.step} in flight did not finish in time")
    handle = None
    if inflight is not None and inflight.step == step and inflight.done() and inflight.error is None:
        handle = inflight  # this step is committed already (saved just before the check)
        ckpt._inflight = None
    else:
        try:
            ckpt._raise_pending()
        except Exception as exc:  # noqa: BLE001 - an older save failed: this one replaces it
            log.warning("preemption: the previous save failed (%s); saving step %d now", exc, step)
        try:
            handle = save()
        except Exception as exc:  # noqa: BLE001 - the save could not start: the step is lost
            end_lost(ckpt, f"the save of step {step} failed: {type(exc).__name__}: {exc}")
    if not handle.wait_done(notice.remaining()):
        end_lost(ckpt, f"the save of step {step} was not committed within {notice.config.deadline:g} s")
    if handle.error is not None:
        handle.mark_reported()
        end_lost(ckpt, f"the save of step {step} failed: {handle.error}")
    end_saved(ckpt, step)


def end_saved(ckpt: Any, step: int) -> None:
    """Step `step` is committed: record the ending, exit 75 (SystemExit: cleanup runs)."""
    notice: Notice = ckpt._notice
    if not notice.decide(PREEMPTED_SAVED):
        threading.Event().wait()  # the watcher decided first and ends the process
    took = notice.elapsed()
    reason = (f"{notice.signal_name}: saved step {step} in {took:.2f} s "
              f"(deadline {notice.config.deadline:g} s)")
    record_ending(PREEMPTED_SAVED, reason, recorder=ckpt._attempt, signal=notice.signal_name,
                  step=step, seconds=round(took, 3))
    log.warning("preempted (%s); exiting with status %d", reason, EXIT_PREEMPTED)
    ckpt.close()
    raise SystemExit(EXIT_PREEMPTED)


def end_lost(ckpt: Any, why: str) -> None:
    """No step commits in time: no manifest is written from now on, record the ending, exit 76
    at once (a save still in flight may hang; nothing waits for it)."""
    notice: Notice = ckpt._notice
    ckpt._setup.abandon()
    if not notice.decide(PREEMPTED_LOST):
        threading.Event().wait()  # the other thread decided first and ends the process
    reason = (f"{notice.signal_name or 'a preemption notice'}: not saved: {why} "
              f"({notice.elapsed():.2f} s after the notice; the previous checkpoint is the newest)")
    record_ending(PREEMPTED_LOST, reason, recorder=ckpt._attempt, signal=notice.signal_name)
    log.error("preempted, not saved (%s); exiting with status %d", reason, EXIT_PREEMPTED_LOST)
    print(f"shardloader: preempted, not saved: {reason}", file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - exiting anyway
            pass
    os._exit(EXIT_PREEMPTED_LOST)


def at_deadline(ckpt: Any | None) -> None:
    """The watcher thread, at the deadline: the step was not committed in time (unless its
    manifest was written just now: then the training thread records it saved)."""
    if ckpt is None:  # the Checkpointer was dropped: nothing to save
        return
    notice: Notice = ckpt._notice
    inflight = ckpt._inflight
    written = ckpt._setup.abandon()
    if inflight is not None and inflight.id in written and inflight.step == notice.saving:
        return
    end_lost(ckpt, f"no save of the current step committed within {notice.config.deadline:g} s")
