"""`Watchdog`: ends an attempt whose rank makes no step progress within a bound.

A rank that hangs (a dead network mount, a peer stuck before a collective) keeps every other
rank waiting until a collective's timeout (30 minutes by default with NCCL), and a launcher that
restarts failed ranks (`torchrun --max-restarts`) never learns of it. The watchdog is a daemon
thread in each rank fed by the step counter the job recorder publishes for every batch the
training loader delivers (`recorder.AttemptRecorder.on_next`). When that counter stands still
for `seconds`, it

1. writes to stderr what hung: the rank, for how long, after which step, and where the training
   thread waits (its Python stack, from `sys._current_frames()`), then every thread's stack
   (`faulthandler`);
2. records the attempt's ending "hung" with that message (`endings.record_ending`: the counters
   and the `end` event are flushed);
3. exits the process with `HUNG_EXIT_CODE` (`os._exit`: the training thread is stuck and never
   unwinds), `exit_grace` seconds later: the other ranks stalled with it (they wait for it in
   a collective) meanwhile record their own stacks, before a launcher that sees this rank exit
   stops them, so the account holds the stuck rank's stack beside theirs. Under torchrun the agent sees a failed rank, stops the others and, within
   `--max-restarts`, starts the group again, which resumes from the newest checkpoint.

What is not a hang:

- the attempt's start-up, up to its first step (imports, the process group, the restore, the
  workers' start and the first batch): the watch begins at the first step;
- a phase marked `paused(phase)`: the Checkpointer marks its saves, waits, restores and close
  (a 60 s save is no hang; such waits are bounded by the Checkpointer's own `timeout`); a user
  marks validation or any long phase of their own, `with ckpt.watchdog.paused("validation"):`.
  The clock starts again at the end of the phase;
- `progress()`: a loop that makes progress without the training loader says so.

So `seconds` bounds one training step (an epoch's first step includes its workers' start),
with room for the slowest rank: every rank waits for it in the step's collectives.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from shardloader.telemetry.job.endings import record_ending

#: The exit status of a process its watchdog ended (as `timeout(1)`'s "timed out").
HUNG_EXIT_CODE = 124
#: How long the ending's record may take before the process exits without it.
RECORD_SECONDS = 5.0
#: The most seconds between the record of a hang and the exit (`Watchdog.exit_grace`).
EXIT_GRACE_SECONDS = 10.0

F = TypeVar("F", bound=Callable[..., Any])


def checked_seconds(seconds: Any) -> float | None:
    """`seconds` as the watchdog's bound, or a ValueError naming the argument."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 \
            or seconds == float("inf"):
        raise ValueError(f"watchdog_seconds must be a positive number of seconds or None, "
                         f"got {seconds!r}")
    return float(seconds)


class Watchdog:
    """Ends this process (`HUNG_EXIT_CODE`) when `recorder`'s step counter stands still for
    `seconds` outside a paused phase; `seconds` None: never (the phases are still kept, so that
    code may mark them whether or not the watch is on). The training thread is the one that
    makes the watchdog."""

    def __init__(self, recorder: Any, seconds: float | None, *,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.seconds = checked_seconds(seconds)
        #: seconds from the record of a hang to the exit: a quarter of the bound, at most 10 s
        self.exit_grace = 0.0 if self.seconds is None else min(EXIT_GRACE_SECONDS, self.seconds / 4)
        self._recorder = recorder
        self._training = threading.current_thread()
        self._exit = exit
        self._lock = threading.Lock()
        self._phases: list[str] = []  # the paused phases now, innermost last
        self._steps = recorder.values["steps"]
        self._since: float | None = None  # monotonic time of the last progress; None: start-up
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.seconds is not None:
            self._thread = threading.Thread(target=self._watch, name="shardloader-watchdog",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.stop)  # interpreter exit (an at-exit wait for a save) is no hang

    @property
    def enabled(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    @contextmanager
    def paused(self, phase: str) -> Iterator[None]:
        """No hang while the block runs (a save, a restore, validation): the clock starts
        again at its end."""
        with self._lock:
            self._phases.append(phase)
        try:
            yield
        finally:
            with self._lock:
                self._phases.remove(phase)
                if self._since is not None:
                    self._since = time.monotonic()

    def progress(self) -> None:
        """The training made progress now (a step of a loop the training loader does not
        drive); starts the watch if no step has yet."""
        with self._lock:
            self._since = time.monotonic()

    def stop(self) -> None:
        """Stop watching (the Checkpointer is closed, the interpreter exits)."""
        self._stop.set()
        atexit.unregister(self.stop)

    # -- the watch thread ------------------------------------------------------------------------
    def _stalled(self, now: float) -> float | None:
        """Seconds without progress now (None: not watched now: start-up or a paused phase)."""
        with self._lock:
            steps = self._recorder.values["steps"]
            if steps != self._steps:
                self._steps, self._since = steps, now
            if self._phases or self._since is None:
                return None
            return now - self._since

    def _watch(self) -> None:
        assert self.seconds is not None
        poll = min(1.0, self.seconds / 20)
        while not self._stop.wait(poll):
            stalled = self._stalled(time.monotonic())
            if stalled is not None and stalled >= self.seconds and not self._stop.is_set():
                self._hung(stalled)
                return

    def describe(self, stalled: float) -> str:
        """What hung: the first line names the rank and the bound, then the training thread's
        stack."""
        frame = sys._current_frames().get(self._training.ident or -1)
        stack = ("".join(traceback.format_stack(frame)) if frame is not None
                 else "  (the training thread has ended)\n")
        return (f"rank {self._recorder.rank} made no step progress for {stalled:.1f} s "
                f"(watchdog_seconds={self.seconds:g}) after its batch {int(self._steps)}; its "
                f"training thread ({self._training.name}) waits in:\n{stack}")

    def _hung(self, stalled: float) -> None:
        message = self.describe(stalled)
        try:  # straight to the descriptor: the stuck thread may hold sys.stderr's lock
            os.write(2, f"shardloader watchdog: hung: {message}all threads:\n".encode())
            faulthandler.dump_traceback(file=2, all_threads=True)
        except OSError:
            pass

        def record() -> None:
            record_ending("hung", message.rstrip("\n"))
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass

        # bounded: a stuck training thread could hold a lock the record needs
        recorder = threading.Thread(target=record, name="shardloader-watchdog-record", daemon=True)
        started = time.monotonic()
        recorder.start()
        recorder.join(RECORD_SECONDS)
        time.sleep(max(0.0, self.exit_grace - (time.monotonic() - started)))
        self._exit(HUNG_EXIT_CODE)


def pauses(phase: str) -> Callable[[F], F]:
    """A method of an object with a `watchdog` (a `Watchdog`) during which the watchdog waits."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def paused_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.watchdog.paused(phase):
                return method(self, *args, **kwargs)
        return paused_method  # type: ignore[return-value]
    return wrap
