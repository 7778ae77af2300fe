"""Checkpoint storage on s3:// retries as the shard cache does: a Checkpointer saving to and
loading from a real S3 server (moto) behind the fault proxy, while every request of one kind
(uploads, HEADs, listings, manifest reads, part reads, deletes) first fails several times in a
row, commits, keeps and loads bit-identical state; without shardloader's retries the same
faults break it. A permanent 403 is not retried: a FetchError naming the object's URL, raised
(as the cause of a CheckpointError) at the next call into the checkpointer."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from shardloader.checkpoint import Checkpointer, CheckpointWarning
from shardloader.errors import CheckpointError, FetchError
from shardloader.io.retry import RetryPolicy
from tests.fixtures.servers import Fault

FAST = RetryPolicy(attempts=10, base_delay=0.001, max_delay=0.01)
NO_RETRY = RetryPolicy(attempts=1)

#: Requests by what checkpoint storage makes them for (S3, path-style URLs), and how many of
#: that kind in a row one call may need (listing a root that does not exist yet takes two).
KINDS = {
    "upload": (lambda m, p, h: m == "PUT", 1),  # part files and the manifest
    "head": (lambda m, p, h: m == "HEAD", 1),  # sizes, existence, opening a part
    "listing": (lambda m, p, h: m == "GET" and "list-type=" in p, 2),
    "manifest": (lambda m, p, h: m == "GET" and "list-type=" not in p and "range" not in h, 1),
    # a part's blocks after its first (8 MiB each): a stream that fails in the middle
    "mid-stream": (lambda m, p, h: m == "GET" and not h.get("range", "bytes=0-").startswith("bytes=0-"), 1),
    "delete": (lambda m, p, h: m in ("DELETE", "POST"), 1),  # the manifest, then the rest
}

# Each burst is longer than what the libraries below absorb in one call (botocore's retries
# off; s3fs's own: at most 2 requests per call for a 503, 3 for a reset): every call hit by
# one succeeds only through shardloader's retries, as the NO_RETRY runs show.
FAULTS = [pytest.param(Fault("status", status=503), 3, id="503"),
          pytest.param(Fault("reset"), 6, id="reset")]


def _options(s3_server, endpoint: str) -> dict:
    """The fixture's options with botocore's retries off entirely (its `max_attempts` counts
    retries after the first attempt; `total_max_attempts` counts attempts)."""
    options = s3_server.storage_options(endpoint, timeout=10)
    options["config_kwargs"]["retries"] = {"total_max_attempts": 1, "mode": "standard"}
    return options


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def bursts(kind: str, fault: Fault, n: int, *, times: int = 2):
    """Fault `n` requests of `kind` in a row, let as many through as one call needs, and
    again: `times` bursts, each hitting a different call."""
    match, gap = KINDS[kind]
    counter, lock = iter(range(1 << 62)), threading.Lock()

    def plan(number, method, path, headers):
        if not match(method, path, _lower(headers)):
            return None
        with lock:
            i = next(counter)
        return fault if i < times * (n + gap) and i % (n + gap) < n else None

    return plan


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        # 12 MB: a part file read back in more than one 8 MiB block (a fault mid-stream)
        "weights": torch.randn(3_000_000, generator=g),
        "half": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "counts": torch.randint(0, 1 << 40, (100,), generator=g),
        "meta": {"step": step, "name": f"run-{step}", "lr": 0.1 / step},
    }


def _bits(value):
    """The value with every tensor as (dtype, shape, raw bytes): equal means bit-identical."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape), value.contiguous().view(torch.uint8).numpy().tobytes()
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    return value


def _save_then_load(url: str, options: dict, staging, retry: RetryPolicy):
    """Save steps 1 and 2 (keep=1: retention deletes step 1), then load the newest in a fresh
    Checkpointer; returns (steps, retention errors, loaded step, loaded extras as bits)."""
    with Checkpointer(url, keep=1, staging_dir=staging / "w", storage_options=options,
                      retry=retry) as ck:
        ck.save(1, **_state(1))
        ck.save(2, **_state(2))  # waits for step 1 (and raises its error)
        ck.wait()
        retention_errors = ck.stats()["retention_errors"]
    with Checkpointer(url, staging_dir=staging / "r", storage_options=options, retry=retry) as fresh:
        steps = fresh.steps()
        step = fresh.load()
        return steps, retention_errors, step, _bits(fresh.loaded_extra)


EXPECTED = ([2], 0, 2, _bits(_state(2)))  # retention done, step 2 loaded bit-identical


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fault, n", FAULTS)
def test_checkpoints_on_s3_survive_transient_faults(s3_server, s3_bucket, fault_proxy, tmp_path,
                                                    kind, fault, n):
    proxy = fault_proxy(s3_server.endpoint, bursts(kind, fault, n))
    url = f"s3://{s3_bucket}/run"

    with warnings.catch_warnings(record=True) as caught:  # the writer thread's too
        warnings.simplefilter("always")
        assert _save_then_load(url, _options(s3_server, proxy.url), tmp_path, FAST) == EXPECTED
    assert [w for w in caught if issubclass(w.category, CheckpointWarning)] == []

    faulted = [e for e in proxy.settled() if e.fault]
    # Both bursts hit. The proxy faults answers, not requests: a delete retried after its
    # answer was lost finds its work done and needs no more requests (the second burst's rest).
    assert n < len(faulted) <= 2 * n
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    checkpoints = {k.split("/")[1] for k in keys} - {".job"}  # .job: the job's records
    assert [d[:15] for d in checkpoints] == ["step-0000000002"]  # 1 all gone

    # The same faults without shardloader's retries: the run does not come through.
    control = fault_proxy(s3_server.endpoint, bursts(kind, fault, n))
    try:
        with warnings.catch_warnings(record=True):  # e.g. retention failed: outcome says so
            outcome = _save_then_load(f"s3://{s3_server.create_bucket()}/run",
                                      _options(s3_server, control.url), tmp_path / "control",
                                      NO_RETRY)
    except (CheckpointError, FetchError):
        return
    assert outcome != EXPECTED


def test_a_permanent_403_is_not_retried_and_names_the_url(s3_server, s3_bucket, fault_proxy,
                                                          tmp_path):
    denied = {"PUT": False, "GET": False}

    def plan(number, method, path, headers):
        if denied.get(method) and (method == "PUT" or "range" in _lower(headers)):
            return Fault("status", status=403)
        return None

    proxy = fault_proxy(s3_server.endpoint, plan)
    url = f"s3://{s3_bucket}/run"
    ck = Checkpointer(url, staging_dir=tmp_path, storage_options=_options(s3_server, proxy.url),
                      retry=FAST)
    try:
        denied["PUT"] = True
        handle = ck.save(1, **_state(1))  # returns: the upload fails in the background
        part = f"{url}/{handle.id}/state.json"
        with pytest.raises(CheckpointError, match=r"step 1 .*failed during upload") as excinfo:
            ck.save(2, **_state(2))  # the next call raises it, and does not save
        cause = excinfo.value.__cause__
        assert isinstance(cause, FetchError)
        assert str(cause).startswith(f"{part}: access denied (HTTP 403")
        assert [e.method for e in proxy.settled() if e.fault] == ["PUT"]  # asked once
        assert ck.steps() == []

        denied["PUT"] = False
        ck.save(3, **_state(3)).wait()
        denied["GET"] = True  # the parts can no longer be read: not damage, an error
        with pytest.raises(FetchError, match=rf"^{url}/step-0*3-\w+/state\.\w+: access denied"):
            ck.load()
        assert len([e for e in proxy.settled() if e.fault]) == 2
    finally:
        denied["PUT"] = denied["GET"] = False
        ck.close()
