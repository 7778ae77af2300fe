"""Is an MLflow tracking server there and answering? One short HTTP request tells.

A TCP connect is not enough: a server (or a proxy, or a wedged load balancer) can accept
connections and never answer, and MLflow's own client then waits `MLFLOW_HTTP_REQUEST_TIMEOUT`
(120 s) per attempt, times `MLFLOW_HTTP_REQUEST_MAX_RETRIES` (7) attempts with backoff. So the
delivery side and `shardloader report` first send one `GET <uri>/health` with a short timeout:
any HTTP answer (even 401 or 404: something speaks HTTP there) counts as answering. Stores that
are not HTTP (a local directory, sqlite, a database URL) are not probed.
"""

from __future__ import annotations

import functools
import socket
import ssl
import urllib.error
import urllib.request
from urllib.parse import urlparse


def is_http(tracking_uri: str) -> bool:
    """Whether `tracking_uri` names an HTTP(S) tracking server."""
    return urlparse(tracking_uri).scheme in ("http", "https")


def is_local_store(tracking_uri: str) -> bool:
    """Whether `tracking_uri` is a store on this machine's file system (a path, file:, sqlite:
    with a path): talking to it involves no network."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme == "":
        return tracking_uri.split("/")[0] not in ("databricks", "databricks-uc")  # MLflow names
    if parsed.scheme == "file":
        return True
    return parsed.scheme == "sqlite" and parsed.netloc == ""


def probe(tracking_uri: str, timeout: float = 2.0) -> str | None:
    """None if the tracking server answers an HTTP request within `timeout` seconds (or the
    URI is not HTTP); otherwise a short reason, e.g. "connection refused" or
    "no answer within 2 s"."""
    if not is_http(tracking_uri):
        return None
    url = tracking_uri.rstrip("/") + "/health"
    context = _tls_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context):
            return None
    except urllib.error.HTTPError:
        return None  # an HTTP status: the server answers
    except urllib.error.URLError as exc:
        return _reason(exc.reason, timeout)
    except (OSError, ValueError) as exc:  # socket.timeout while reading, bad URL
        return _reason(exc, timeout)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One context for every probe: making one loads the CA bundle, tens of ms of CPU, and the
    logger probes before each delivery (once a second)."""
    context = ssl.create_default_context()
    context.check_hostname = False  # liveness only; MLflow's own calls verify as configured
    context.verify_mode = ssl.CERT_NONE
    return context


def _reason(exc: object, timeout: float) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror or exc})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({exc})"
    return str(exc) or type(exc).__name__
