"""A credential gate in front of moto's server: temporary AWS credentials that really expire.

Used by the credential tests (`tests/fixtures/credentials.py`) and `benchmarks.coldstart_sources`
(every credential source's cold first batch).

moto's server answers S3, STS and instance metadata, but checks no credential: any key reads,
and its instance metadata hands out one fixed key for a day. So the tests of credential
sources talk to moto through this gate, on 127.0.0.1, which does what AWS does with
temporary credentials:

* Instance metadata (``/latest/...``, IMDSv2 included) is moto's answer, with each credentials
  document given a new access key and an ``Expiration`` `lifetime` seconds away.
* STS (``AssumeRoleWithWebIdentity``, ``AssumeRole``) is moto's answer, with its
  ``Expiration`` moved `lifetime` seconds away.
* ``/__container`` answers as the container credentials endpoint (ECS, EKS Pod Identity) and
  ``/__issue`` as a ``credential_process`` prints: new temporary credentials each call.
* ``/federation/credentials`` answers as IAM Identity Center's (SSO) portal does
  (``GetRoleCredentials``): new temporary credentials for a request that carries `SSO_TOKEN`
  as its bearer token (the token ``aws sso login`` leaves in its cache), 401 otherwise.
* Every other request is S3: forwarded to moto only when the access key of its
  ``Authorization`` header was issued above (or allowed with `allow`) and has not expired;
  else 403 with S3's ``ExpiredToken`` or ``InvalidAccessKeyId``, as S3 answers.

``gate.s3_requests`` lists (time, access key, path, status) of every S3 request.
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import itertools
import json
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_KEY_IN_AUTH = re.compile(r"Credential=([^/]+)/")
_IMDS_CREDENTIALS = re.compile(r"^/latest/meta-data/iam/security-credentials/[^/]+$")
_STS_EXPIRATION = re.compile(rb"<Expiration>[^<]*</Expiration>")
_STS_KEY = re.compile(rb"<AccessKeyId>([^<]+)</AccessKeyId>")
SSO_TOKEN = "an-sso-access-token"  # noqa: S105 - a test token, valid only at this gate
#: Headers of moto's answer not passed on: this connection's own, and those _answer sets.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                          "server", "date"})


def write_sso_profile(config_dir: str, token_cache_dir: str, profile: str = "training") -> str:
    """What ``aws configure sso`` and ``aws sso login`` leave behind, for this gate's portal: a
    config file with `profile` (an SSO role) in `config_dir`, and the login's token, valid for an
    hour, in `token_cache_dir` (botocore looks in ``~/.aws/sso/cache``). Returns the config file's
    path (for AWS_CONFIG_FILE); the portal's endpoint goes in AWS_ENDPOINT_URL_SSO."""
    start_url = "https://training.awsapps.com/start"
    path = os.path.join(config_dir, "sso-config")
    with open(path, "w") as f:
        f.write(f"[profile {profile}]\nsso_start_url = {start_url}\nsso_region = us-east-1\n"
                f"sso_account_id = 123456789012\nsso_role_name = training\n")
    os.makedirs(token_cache_dir, exist_ok=True)
    name = hashlib.sha1(start_url.encode()).hexdigest()  # noqa: S324 - botocore's cache key
    with open(os.path.join(token_cache_dir, f"{name}.json"), "w") as f:
        json.dump({"startUrl": start_url, "region": "us-east-1", "accessToken": SSO_TOKEN,
                   "expiresAt": _iso(time.time() + 3600)}, f)
    return path


def _iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class CredentialGate:
    upstream: str  # moto's server, http://host:port
    lifetime: float
    url: str = ""
    expiry: dict[str, float] = field(default_factory=dict)  # access key -> time.time() it expires
    s3_requests: list[tuple[float, str, str, int]] = field(default_factory=list)
    _numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def allow(self, key: str, expires: float = float("inf")) -> None:
        with self._lock:
            self.expiry[key] = expires

    def issue(self, prefix: str) -> dict[str, str]:
        """New temporary credentials, valid for `lifetime` seconds from now."""
        with self._lock:
            key = f"ASIA{prefix}{next(self._numbers):08d}"
            expires = time.time() + self.lifetime
            self.expiry[key] = expires
        return {"AccessKeyId": key, "SecretAccessKey": f"secret-{key}",
                "Token": f"token-{key}", "Expiration": _iso(expires)}

    def keys_used(self) -> list[str]:
        """The access keys of accepted S3 requests, each once, in order of first use."""
        return list(dict.fromkeys(key for _, key, _, status in self.s3_requests if status < 400))

    def refused(self) -> list[tuple[float, str, str, int]]:
        return [r for r in self.s3_requests if r[3] == 403]

    # -- the server -----------------------------------------------------------------------------
    def start(self) -> CredentialGate:
        gate = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                gate._handle(self)

            do_PUT = do_POST = do_HEAD = do_DELETE = do_GET  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        path = request.path
        if path == "/__container":
            document = self.issue("CONT")
            return _answer(request, 200, json.dumps(document).encode(), "application/json")
        if path == "/__issue":  # what a credential_process prints
            d = self.issue("PROC")
            out = {"Version": 1, "AccessKeyId": d["AccessKeyId"], "SecretAccessKey": d["SecretAccessKey"],
                   "SessionToken": d["Token"], "Expiration": d["Expiration"]}
            return _answer(request, 200, json.dumps(out).encode(), "application/json")
        if path.startswith("/federation/credentials"):
            return self._sso(request)
        if path.startswith("/latest/"):
            status, answer, _ = self._forward(request, body, host="169.254.169.254")
            if status == 200 and _IMDS_CREDENTIALS.match(path.split("?")[0]):
                document = json.loads(answer)
                document.update(self.issue("IMDS"))
                answer = json.dumps(document).encode()
            return _answer(request, status, answer, "text/plain")
        if b"Action=AssumeRole" in body:
            status, answer, _ = self._forward(request, body)
            found = _STS_KEY.search(answer)
            if status == 200 and found:
                expires = time.time() + self.lifetime
                self.allow(found.group(1).decode(), expires)
                answer = _STS_EXPIRATION.sub(f"<Expiration>{_iso(expires)}</Expiration>".encode(), answer)
            return _answer(request, status, answer, "text/xml")
        self._s3(request, body)

    def _sso(self, request: BaseHTTPRequestHandler) -> None:
        """The SSO portal's GetRoleCredentials: its JSON, expiration in milliseconds."""
        if request.headers.get("x-amz-sso_bearer_token") != SSO_TOKEN:
            error = {"message": "Session token not found or invalid"}
            return _answer(request, 401, json.dumps(error).encode(), "application/json",
                           {"x-amzn-errortype": "UnauthorizedException"})
        d = self.issue("SSO")
        expires = int(self.expiry[d["AccessKeyId"]] * 1000)
        out = {"roleCredentials": {"accessKeyId": d["AccessKeyId"], "secretAccessKey": d["SecretAccessKey"],
                                   "sessionToken": d["Token"], "expiration": expires}}
        return _answer(request, 200, json.dumps(out).encode(), "application/json")

    def _s3(self, request: BaseHTTPRequestHandler, body: bytes) -> None:
        found = _KEY_IN_AUTH.search(request.headers.get("Authorization", ""))
        key = found.group(1) if found else ""
        expires = self.expiry.get(key)
        if expires is None or time.time() >= expires:
            code = "InvalidAccessKeyId" if expires is None else "ExpiredToken"
            with self._lock:
                self.s3_requests.append((time.time(), key, request.path, 403))
            xml = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
            return _answer(request, 403, xml, "application/xml")
        status, answer, headers = self._forward(request, body)
        with self._lock:
            self.s3_requests.append((time.time(), key, request.path, status))
        _answer(request, status, answer, headers.pop("content-type", "application/xml"), headers)

    def _forward(self, request: BaseHTTPRequestHandler, body: bytes, host: str | None = None
                 ) -> tuple[int, bytes, dict[str, str]]:
        """moto's (status, body, headers worth passing on) for `request`."""
        target = urllib.parse.urlsplit(self.upstream)
        connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "connection")}
            headers["Host"] = host or f"{target.hostname}:{target.port}"
            connection.request(request.command, request.path, body=body or None, headers=headers)
            response = connection.getresponse()
            answer = response.read()
            passed = {k.lower(): v for k, v in response.getheaders() if k.lower() not in _HOP_HEADERS}
            if request.command == "HEAD":
                passed["content-length"] = response.getheader("Content-Length", "0")
            return response.status, answer, passed
        finally:
            connection.close()


def _answer(request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str,
            headers: dict[str, str] | None = None) -> None:
    request.send_response(status)
    request.send_header("Content-Type", content_type)
    headers = dict(headers or {})
    request.send_header("Content-Length", headers.pop("content-length", str(len(body))))
    for name, value in headers.items():
        request.send_header(name, value)
    request.end_headers()
    if request.command != "HEAD":
        request.wfile.write(body)
