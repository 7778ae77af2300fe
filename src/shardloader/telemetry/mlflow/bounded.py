"""Bounded calls to an MLflow tracking server: per request (`request_bounds`) and, for a command
that must not outwait a dead server, all of its calls together (`BoundedServer`).

MLflow's client waits `MLFLOW_HTTP_REQUEST_TIMEOUT` (120 s) for each request and retries it
`MLFLOW_HTTP_REQUEST_MAX_RETRIES` (7) times, with a backoff of 4 s doubling up to 120 s
between tries. So a server that answers the start-up probe (`probe.probe`) and then dies held
`shardloader report` for 247 s of retries before its first error, and one that then stops
answering for 8 x 120 s + 247 s = 1,210 s.

`BoundedServer.call(what, fn, ...)` runs one step of a command against the server (reading a
run's metric histories, logging artifacts) with both bounded:

- each HTTP request MLflow makes waits at most `timeout` seconds for an answer (rounded up to
  a whole second: MLflow reads an integer) and is not retried (`MLFLOW_HTTP_REQUEST_TIMEOUT`,
  `MLFLOW_HTTP_REQUEST_MAX_RETRIES=0`, set for the duration of the call and restored after);
- all calls together take at most `deadline` seconds: each step runs in a helper thread that
  the caller stops waiting for when the time left is spent. Only this catches a server that
  trickles bytes, which no per-request timeout does.

`request_bounds(seconds)` is the first of those alone. MLflow 3.x reads both variables from
`os.environ` at the start of every request (`mlflow.utils.rest_utils.http_request`) and has no
per-client setting, so they are set for the duration of the calls and restored after:
process-wide, which suits a command of its own (`shardloader report`), not a training process
whose environment is the user's (`MLflowLogger` leaves it alone; see `delivery`). Overlapping
blocks share one setting (the latest one's), counted so that the last to leave restores what
was there before the first. A child forked meanwhile gets the variables as they were before
(`os.register_at_fork`).

A server that refuses connections, resets them or does not answer within `timeout` becomes a
`TelemetryInputError` naming the server, the step and the reason; any other error of the step
(an unknown run, an HTTP error status) is raised unchanged. Stores that are not HTTP (a local
directory, sqlite) are called directly, with neither bound.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from shardloader.telemetry.mlflow.probe import is_http
from shardloader.telemetry.records import TelemetryInputError

T = TypeVar("T")

#: Seconds each request to the tracking server may wait for its answer (`report --timeout`).
REQUEST_TIMEOUT = 5.0
#: Seconds all of a command's calls to the tracking server may take together
#: (`report --deadline`): reading a run of a few hundred thousand steps takes seconds.
COMMAND_DEADLINE = 120.0

_TIMEOUT_ENV = "MLFLOW_HTTP_REQUEST_TIMEOUT"
_RETRIES_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"


class BoundedServer:
    """Calls to the tracking server `uri` under a per-request `timeout` and one `deadline`."""

    def __init__(self, uri: str, timeout: float = REQUEST_TIMEOUT,
                 deadline: float = COMMAND_DEADLINE) -> None:
        if not timeout > 0 or not deadline > 0:
            raise ValueError(f"timeout and deadline must be positive, got {timeout!r}, {deadline!r}")
        self.uri = uri
        self.timeout = timeout
        self.deadline = deadline
        self._left = deadline  # seconds the calls may still take

    @property
    def request_seconds(self) -> int:
        """The per-request timeout MLflow applies: `timeout` rounded up to whole seconds."""
        return max(1, math.ceil(self.timeout))

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` under the bounds; `what` ("reading run X") names the step."""
        if not is_http(self.uri):
            return fn(*args, **kwargs)
        if self._left <= 0:
            raise self._late(what)
        outcome: dict[str, Any] = {}

        def step() -> None:
            try:
                outcome["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                outcome["error"] = e

        with request_bounds(self.timeout):
            worker = threading.Thread(target=step, name="shardloader-mlflow-call", daemon=True)
            started = time.monotonic()
            worker.start()
            worker.join(self._left)
            self._left -= time.monotonic() - started
        if worker.is_alive():  # a daemon: it ends with the process, or with its request
            raise self._late(what)
        if "error" in outcome:
            error = outcome["error"]
            reason = unreachable_reason(error, self.request_seconds)
            if reason is not None:
                raise TelemetryInputError(
                    f"MLflow tracking server {self.uri} stopped answering while {what}: {reason} "
                    f"(each request waits at most {self.request_seconds} s, --timeout, and is not "
                    "retried; is the server still running?)") from None
            raise error
        return outcome["value"]

    def _late(self, what: str) -> TelemetryInputError:
        return TelemetryInputError(
            f"MLflow tracking server {self.uri}: {what} did not finish within the command's "
            f"{self.deadline:g} s deadline (--deadline): the server answers too slowly, or "
            "the run is very large (raise --deadline)")


def unreachable_reason(error: BaseException, timeout: float) -> str | None:
    """Why `error` (raised by MLflow's client) means the server could not be reached or did
    not answer: "connection refused", "no answer within 5 s", ...; None for any other error."""
    chain = list(_causes(error))
    names = {type(e).__name__ for e in chain}
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return "connection refused"
    if any(isinstance(e, TimeoutError) for e in chain) or names & _TIMEOUT_TYPES:
        return f"no answer within {timeout:g} s"
    if any(isinstance(e, (ConnectionResetError, BrokenPipeError)) for e in chain) or \
            names & _CLOSED_TYPES:
        return "the connection was closed without an answer"
    if names & _CONNECTION_TYPES:
        return f"connection failed ({chain[-1]})"
    return None


# Exception types of requests/urllib3/http.client, by name (no import of them needed here).
_TIMEOUT_TYPES = frozenset({"ReadTimeout", "ReadTimeoutError", "ConnectTimeout",
                            "ConnectTimeoutError", "Timeout"})
_CLOSED_TYPES = frozenset({"RemoteDisconnected", "ProtocolError", "ChunkedEncodingError",
                           "IncompleteRead"})
_CONNECTION_TYPES = frozenset({"NewConnectionError", "MaxRetryError", "NameResolutionError"})


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, its causes and contexts, and the `reason` urllib3 keeps in MaxRetryError."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for linked in (current.__cause__, current.__context__, getattr(current, "reason", None),
                       *current.args):
            if isinstance(linked, BaseException):
                pending.append(linked)


@contextmanager
def request_bounds(timeout: float) -> Iterator[None]:
    """Within the block, each HTTP request MLflow's client makes waits at most `timeout` seconds
    (rounded up to a whole second) and is not retried; see the module's docstring."""
    global _users
    with _bounds_lock:
        for key, value in ((_TIMEOUT_ENV, str(max(1, math.ceil(timeout)))), (_RETRIES_ENV, "0")):
            if _users == 0:
                _saved[key] = os.environ.get(key)
            os.environ[key] = value  # each block sets them: someone may have changed them
        _users += 1
    try:
        yield
    finally:
        with _bounds_lock:
            _users -= 1
            if _users == 0:
                _restore()


def _restore() -> None:
    for key, value in _saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _saved.clear()


def _reset_in_forked_child() -> None:
    """A child forked inside a `request_bounds` block: its environment as it was before the
    block, and a lock no thread of the parent can be holding."""
    global _bounds_lock, _users
    _bounds_lock = threading.Lock()
    if _users:
        _restore()
    _users = 0


_bounds_lock = threading.Lock()
_users = 0  # request_bounds blocks open in this process
_saved: dict[str, str | None] = {}  # the variables' values before the first of them

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_forked_child)
