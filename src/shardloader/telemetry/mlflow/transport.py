"""Where `MLflowLogger`'s delivery side runs: in its background thread, or in a writer process.

Both transports take the same calls from the logger's background thread (`send` rows, `tick`,
`flush` and `close` by a `time.monotonic()` deadline, `kill`) and answer with the delivery
side's state (a plain dict; None when a writer process did not answer in time).
`ThreadTransport` runs the `Delivery` right there; `ProcessTransport` starts
`python -m shardloader.telemetry.mlflow.writer` and talks to it over a socket pair, so that
MLflow's per-metric CPU never holds the training process's GIL. Every MLflow request of the
writer is capped at `request_timeout` seconds with no retries of MLflow's own.

Fork safety: the trainer's end of a writer's socket is closed in every child forked later
(loader workers), so only the trainer holds it and the writer sees end-of-file when the
trainer is gone.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
import time
import weakref
from typing import Any

import shardloader._version
from shardloader.telemetry.mlflow.delivery import Delivery

log = logging.getLogger(__name__)

# Margins inside close()'s deadline: the writer stops this much earlier, so its final report
# arrives before the training side gives up on it.
_WRITER_CLOSE_MARGIN = 0.5
_REPLY_MARGIN = 0.2

class ThreadTransport:
    """Delivery in the logger's own background thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.delivery = Delivery(**config)
        self.delivery.start()

    def send(self, rows: list[tuple[Any, ...]]) -> dict[str, Any]:
        self.delivery.add(rows)
        self.delivery.deliver()
        return self.delivery.state()

    def tick(self) -> dict[str, Any]:
        self.delivery.deliver()
        return self.delivery.state()

    def flush(self, deadline: float) -> dict[str, Any]:
        self.delivery.deliver(force=True)
        return self.delivery.state()

    def close(self, deadline: float) -> dict[str, Any]:
        self.delivery.close(deadline - _WRITER_CLOSE_MARGIN)
        return self.delivery.state()

    def kill(self) -> None:
        return None


class ProcessTransport:
    """Delivery in a writer process (`python -m shardloader.telemetry.mlflow.writer`).

    Started from the logger's background thread, which outlives it (the thread ends only after
    closing it), so the writer can arm the parent-death signal. Our end of the socket pair is
    closed in every child forked from this process later (see `_close_in_forked_child`), so
    only the trainer holds it and the writer sees end-of-file when the trainer is gone."""

    def __init__(self, config: dict[str, Any], flush_interval: float,
                 request_timeout: float) -> None:
        from multiprocessing.connection import Connection

        mine, theirs = socket.socketpair()
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(shardloader._version.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
        # Every MLflow request of the writer is bounded, and the Delivery retries with its own
        # backoff instead of MLflow's (7 retries, minutes).
        env["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, math.ceil(request_timeout)))
        env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        self.forked_copy = False
        _FORK_CLOSE.add(mine)
        _FORK_CLOSE.add(theirs)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shardloader.telemetry.mlflow.writer",
                 str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, env=env, close_fds=True,
            )
        finally:
            _FORK_CLOSE.discard(theirs)
            theirs.close()
        _FORK_CLOSE.discard(mine)
        self.conn = Connection(mine.detach())
        _TRANSPORTS.add(self)
        self.seq = 0
        self.conn.send({"delivery": config, "flush_interval": flush_interval})

    def abandon(self) -> None:
        """In a forked child: close our copy of the socket and never touch the writer."""
        self.forked_copy = True
        try:
            self.conn.close()
        except OSError:
            pass

    def _replies(self) -> list[tuple[Any, ...]]:
        out = []
        while self.conn.poll(0):
            out.append(self.conn.recv())
        return out

    def _latest_state(self, replies: list[tuple[Any, ...]]) -> dict[str, Any] | None:
        states = [r[-1] for r in replies if isinstance(r[-1], dict)]
        return states[-1] if states else None

    def send(self, rows: list[tuple[Any, ...]]) -> dict[str, Any] | None:
        self.conn.send(("rows", rows))
        return self._latest_state(self._replies())

    def tick(self) -> dict[str, Any] | None:
        if self.process.poll() is not None:
            raise OSError(f"writer process exited with status {self.process.returncode}")
        return self._latest_state(self._replies())

    def _wait_for(self, kind: str, seq: int | None, deadline: float) -> dict[str, Any] | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                return None
            reply = self.conn.recv()
            if reply[0] == kind and (seq is None or reply[1] == seq):
                return reply[-1]

    def flush(self, deadline: float) -> dict[str, Any] | None:
        self.seq += 1
        self.conn.send(("flush", self.seq))
        return self._wait_for("ack", self.seq, deadline)

    def close(self, deadline: float) -> dict[str, Any] | None:
        writer_left = max(0.1, deadline - time.monotonic() - _WRITER_CLOSE_MARGIN)
        try:
            self.conn.send(("close", writer_left))
            state = self._wait_for("closed", None, deadline - _REPLY_MARGIN)
        except (OSError, EOFError):
            state = None
        try:
            self.process.wait(max(0.1, deadline - _REPLY_MARGIN - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("MLflowLogger: the writer process did not finish in time; killing it")
        self.kill()
        self.conn.close()
        return state

    def kill(self) -> None:
        if self.forked_copy:
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# Sockets to close in a child forked while a writer is being started, and live transports,
# whose socket every forked child closes: a loader worker forked after the writer started must
# not hold the trainer's end, or the writer would not see end-of-file when the trainer dies.
_FORK_CLOSE: set[socket.socket] = set()
_TRANSPORTS: weakref.WeakSet[ProcessTransport] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    for sock in list(_FORK_CLOSE):
        try:
            sock.close()
        except OSError:
            pass
    _FORK_CLOSE.clear()
    for transport in list(_TRANSPORTS):
        transport.abandon()
    _TRANSPORTS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)
