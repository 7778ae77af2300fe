"""The accelerator's idle gap between training steps, measured on the GPU with CUDA events.

`fetch_seconds` is what the host waited for data; the GPU may still have been busy with the
previous step's queued kernels during that wait, in which case no accelerator time was lost.
`GpuIdleTimer` records a CUDA event when a step's work has been enqueued (`step_end`) and
another when the next step begins (`step_start`). The GPU reaches the second event either
right after finishing the previous step (it had queued work: gap ~ 0) or only when the host
enqueues it (it sat idle): the time between the two events is the idle gap. Events are read
with `query()` once complete, so the timer never synchronises the device on the hot path.

On a machine without CUDA (or a CPU device) every method is a no-op and `summary()` is `{}`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

METRIC = "gpu_idle_seconds"


class GpuIdleTimer:
    """Idle gaps of `device` between steps; each gap goes to `sink.log_metrics` when known."""

    def __init__(self, device: Any = None, sink: Any = None, metric: str = METRIC) -> None:
        import torch

        self._torch = torch
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda" and torch.cuda.is_available()
        self.sink = sink
        self.metric = metric
        self._last_end: Any = None
        self._pending: deque[tuple[int | None, Any, Any]] = deque()
        self.steps = 0
        self.total_seconds = 0.0
        self.max_seconds = 0.0
        self._step = 0

    def _event(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def step_start(self, step: int | None = None) -> None:
        """Call when the next step's batch is in hand, before enqueuing its work."""
        if not self.enabled:
            return
        start = self._event()
        if self._last_end is not None:
            self._pending.append((step, self._last_end, start))
            self._last_end = None
        self.poll()

    def step_end(self) -> None:
        """Call when a step's work has been enqueued (e.g. after `optimizer.step()`)."""
        if not self.enabled:
            return
        self._last_end = self._event()

    def poll(self, wait: bool = False) -> list[tuple[int | None, float]]:
        """Collect finished gaps (all of them, synchronising, if `wait`): [(step, seconds)]."""
        done: list[tuple[int | None, float]] = []
        while self._pending:
            step, end, start = self._pending[0]
            if wait:
                start.synchronize()
            elif not start.query():
                break
            self._pending.popleft()
            seconds = max(0.0, end.elapsed_time(start) / 1000.0)
            self.steps += 1
            self.total_seconds += seconds
            self.max_seconds = max(self.max_seconds, seconds)
            done.append((step, seconds))
            if self.sink is not None and step is not None:
                self.sink.log_metrics({self.metric: seconds}, step)
        return done

    def wrap(self, batches: Iterable[T], start_step: int | None = None) -> Iterator[T]:
        """Yield from `batches`, marking each step's start and end around the loop body.

        Steps are numbered from `start_step`, or from the iterable's `step` attribute (the
        Loader's running batch count) when it has one, else from 0.
        """
        step = start_step if start_step is not None else int(getattr(batches, "step", 0) or 0)
        for batch in batches:
            self.step_start(step)
            yield batch
            self.step_end()
            step += 1
        self.poll(wait=True)

    def summary(self) -> Mapping[str, float]:
        """{} on CPU; else gpu_idle_seconds_{total,mean,max} and gpu_idle_steps."""
        if not self.enabled:
            return {}
        return {
            f"{self.metric}_total": self.total_seconds,
            f"{self.metric}_mean": self.total_seconds / self.steps if self.steps else 0.0,
            f"{self.metric}_max": self.max_seconds,
            "gpu_idle_steps": self.steps,
        }

    def close(self) -> None:
        """Collect the gaps still in flight (synchronises once)."""
        self.poll(wait=True)
