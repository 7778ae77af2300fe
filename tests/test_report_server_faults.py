"""`shardloader report` against a tracking server that answers the start-up probe and then stops
answering (SIGSTOP), dies (SIGKILL) or trickles: each fails within the stated bound
(`--timeout` per request, `--deadline` for all of them) with a message naming the server,
instead of MLflow's retry loop (247 s after a death, 1,210 s after a hang)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from shardloader.cli import main as cli_main
from shardloader.telemetry.mlflow import probe as probe_module

SLACK = 4.0  # seconds for a busy 2-core machine on top of a bound


def _log_a_run(url: str) -> str:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(url)
    run = client.create_run(client.create_experiment("faults")).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(run, metrics=[Metric(name, 0.01 * (step % 7), now + step, step)
                                   for step in range(50)
                                   for name in ("fetch_seconds", "transform_seconds")])
    return run


def _after_the_probe(monkeypatch: pytest.MonkeyPatch, action) -> None:
    """Run `action` right after the real probe has found the server answering."""
    real = probe_module.probe

    def probe_then_act(uri: str, timeout: float = 2.0) -> str | None:
        reason = real(uri, timeout)
        assert reason is None, f"the probe should pass, got {reason}"
        action()
        return reason

    monkeypatch.setattr(probe_module, "probe", probe_then_act)


def _report(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, float, str]:
    start = time.monotonic()
    rc = cli_main.main(["report", *argv])
    return rc, time.monotonic() - start, capsys.readouterr().err


@pytest.mark.timeout(240)
def test_a_server_that_stops_answering_or_dies_after_the_probe_is_named_within_the_timeout(
        killable_mlflow_server, monkeypatch, capsys):
    server = killable_mlflow_server
    url = server.url
    run = _log_a_run(url)
    args = [run, "--tracking-uri", url, "--no-artifact", "--timeout", "2"]
    assert _report(args, capsys)[0] == 0  # the run is readable while the server is up
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ  # restored after the command

    # Stops answering: the whole process group stopped; the kernel still accepts connections.
    _after_the_probe(monkeypatch, lambda: os.killpg(server.process.pid, signal.SIGSTOP))
    try:
        rc, elapsed, err = _report(args, capsys)
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
    assert rc == 1
    assert (f"error: MLflow tracking server {url} stopped answering while reading run {run}: "
            "no answer within 2 s (each request waits at most 2 s, --timeout, and is not "
            "retried; is the server still running?)") in err
    assert elapsed < 2 + SLACK, f"took {elapsed:.1f} s"

    # Dies: SIGKILL of the server's whole process group.
    _after_the_probe(monkeypatch, server.kill)
    rc, elapsed, err = _report(args, capsys)
    assert rc == 1
    assert (f"error: MLflow tracking server {url} stopped answering while reading run {run}: "
            "connection refused") in err
    assert elapsed < 2 + SLACK, f"took {elapsed:.1f} s"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ


class TricklingServer:
    """Answers `GET /health` at once; answers anything else with headers and then one byte of
    body a second, forever: no single read ever times out."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = conn.recv(65536)
                if request.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK")
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000000\r\n\r\n")
                while not self.stop.wait(1.0):  # the server's pace, not a synchronisation
                    conn.sendall(b" ")
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.timeout(120)
def test_a_server_that_trickles_is_cut_off_at_the_deadline(capsys):
    server = TricklingServer()
    try:
        rc, elapsed, err = _report(["0" * 32, "--tracking-uri", server.url, "--timeout", "3",
                                    "--deadline", "4"], capsys)
    finally:
        server.close()
    assert rc == 1
    assert (f"error: MLflow tracking server {server.url}: reading run {'0' * 32} did not finish "
            "within the command's 4 s deadline (--deadline)") in err
    assert 4 <= elapsed < 4 + 3 + SLACK, f"took {elapsed:.1f} s"  # probe (< --timeout) + deadline


def test_local_stores_are_called_directly_and_bad_bounds_are_refused():
    import argparse

    from shardloader.cli import report
    from shardloader.telemetry.mlflow.bounded import (
        COMMAND_DEADLINE,
        REQUEST_TIMEOUT,
        BoundedServer,
    )

    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    args = parser.parse_args(["run-id"])
    assert (args.timeout, args.deadline) == (REQUEST_TIMEOUT, COMMAND_DEADLINE)
    assert BoundedServer("sqlite:///x.db", 1, 1).call("reading", lambda: 7) == 7
    with pytest.raises(ValueError, match="must be positive"):
        BoundedServer("http://127.0.0.1:1", 0, 1)
