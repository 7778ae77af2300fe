"""S3 credentials from every source AWS's chain knows, on the one read path, with temporary
credentials that expire mid-epoch and are refreshed.

Each test reads a remote epoch with worker processes through `tests.fixtures.credentials`'
gate (moto's server behind it: S3 refuses a key once it expired, instance metadata and STS
hand out keys that expire `LIFETIME` seconds after they are issued). Between `Loader()` and
the epoch the script "builds its model" for 2 x LIFETIME, so the key that read the index has
expired before any shard is read, and each batch takes a step of `STEP` seconds. Every batch, its
sample indices and augmented bytes, must equal the same dataset's read locally, and the S3
requests must have been signed with more than one key, none refused: without a refresh, the
reads after the first key's expiry would fail.

Instance metadata is the exception to the mid-epoch refresh (see its test). Keys in the
storage options cannot be refreshed by anyone: they read while valid, and once
expired fail with S3's ExpiredToken on the error's first line.
"""

from __future__ import annotations

import shlex
import sys
import time

import pytest

from benchmarks._credentials import write_sso_profile
from shardloader import Dataset, Loader
from shardloader.ingest.writer import write_shards
from shardloader.io import s3client
from shardloader.io.transfer import read_bytes
from tests.resume import assert_same_batches, record
from tests.sample_transforms import make_samples, noisy_crop

LIFETIME = 3.0  # seconds each temporary key is valid: a loaded machine's margin between a
# key's fetch and the request it signs (botocore fetches one for each request at this lifetime)
STEP = 0.3  # seconds of "training" per batch: the epoch's 15 batches take 4.5 s
ROLE = "arn:aws:iam::123456789012:role/training"


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("credentials-ds") / "ds")
    write_shards(make_samples(120, seed=3), out, shard_samples=15)  # 8 shards
    return out


def _loader(url, cache=None, storage_options=None):
    dataset = Dataset(url, cache_dir=None if cache is None else str(cache), cache_limit="100MB",
                      storage_options=storage_options)
    return Loader(dataset, batch_size=8, seed=7, transform=noisy_crop, shuffle=True,
                  num_workers=2, persistent_workers=True)


@pytest.fixture(scope="module")
def reference(dataset_dir):
    loader = _loader(dataset_dir)
    try:
        return [record(batch) for batch in loader]
    finally:
        loader.close()


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """No credentials anywhere but where a test puts them: no AWS variable, profile files that do
    not exist, instance metadata off; and this process's botocore sessions start afresh (a
    session keeps the credentials it resolved for the life of the process)."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_METADATA_SERVICE_TIMEOUT", "10")  # a loaded 2-core machine
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setattr(s3client, "_SESSIONS", {})
    return monkeypatch


def _options(gate, **extra):
    return {"client_kwargs": {"endpoint_url": gate.url},
            "config_kwargs": {"connect_timeout": 20, "read_timeout": 20}, **extra}


@pytest.fixture
def url(dataset_dir, s3_server):
    """The dataset in a fresh bucket (uploaded before a test changes the environment)."""
    return s3_server.upload_dir(dataset_dir, s3_server.create_bucket(), "ds")


def _read_epoch(url, gate, options, tmp_path):
    """The epoch's batches read through `gate` with `options`, one STEP per batch; and its seconds."""
    started = time.monotonic()
    loader = _loader(url, tmp_path / "cache", options)
    time.sleep(2 * LIFETIME)  # the script builds its model; the key that read the index expires
    got = []
    try:
        for batch in loader:
            got.append(record(batch))
            time.sleep(STEP)  # the training step, not a synchronisation
    finally:
        loader.close()
    return got, time.monotonic() - started


def _assert_refreshed_mid_epoch(gate, got, seconds, reference, prefix):
    assert_same_batches(got, reference, "the epoch read with refreshed credentials")
    assert seconds > 2 * LIFETIME
    assert gate.refused() == [], f"requests refused: {gate.refused()[:3]}"
    keys = gate.keys_used()
    assert len(keys) >= 2, f"one key for the whole epoch ({keys}): credentials were not refreshed"
    assert all(key.startswith(prefix) for key in keys), keys
    last_read = max(t for t, _, _, status in gate.s3_requests if status < 400)
    assert last_read > gate.expiry[keys[0]], "no read after the first key expired: nothing refreshed"


def test_keys_in_the_options(url, reference, credential_gate, aws_env, tmp_path):
    gate = credential_gate(LIFETIME)
    gate.allow("static-key")
    options = _options(gate, key="static-key", secret="static-secret")
    got, _ = _read_epoch(url, gate, options, tmp_path)
    assert_same_batches(got, reference, "keys in the options")
    assert gate.keys_used() == ["static-key"] and gate.refused() == []


def test_expired_keys_in_the_options_fail_with_the_cause_on_the_first_line(
        s3_server, credential_gate, aws_env):
    gate = credential_gate(LIFETIME)
    bucket = s3_server.create_bucket()
    s3_server.put(bucket, "index.json", b"{}")
    gate.allow("short-key", time.time() - 1)  # session keys a user pasted, already expired
    options = _options(gate, key="short-key", secret="s", token="t")
    with pytest.raises(Exception) as caught:
        read_bytes(f"s3://{bucket}/index.json", options)
    first_line = str(caught.value).splitlines()[0]
    assert f"s3://{bucket}/index.json" in first_line and "ExpiredToken" in first_line, first_line


@pytest.mark.parametrize("chosen_by", ["option", "AWS_PROFILE"])
def test_a_profile_whose_credential_process_refreshes(chosen_by, url, reference, credential_gate,
                                                     aws_env, tmp_path):
    gate = credential_gate(LIFETIME)
    fetch = f"import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('{gate.url}/__issue').read().decode())"
    config = tmp_path / "config"
    config.write_text(f"[profile training]\ncredential_process = {shlex.quote(sys.executable)} -c {shlex.quote(fetch)}\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(config))
    extra = {"profile": "training"} if chosen_by == "option" else {}
    if chosen_by == "AWS_PROFILE":
        aws_env.setenv("AWS_PROFILE", "training")
    got, seconds = _read_epoch(url, gate, _options(gate, **extra), tmp_path)
    _assert_refreshed_mid_epoch(gate, got, seconds, reference, "ASIAPROC")


def test_a_profile_file_with_static_keys(url, reference, credential_gate,
                                         aws_env, tmp_path):
    gate = credential_gate(LIFETIME)
    gate.allow("profile-key")
    credentials = tmp_path / "credentials"
    credentials.write_text("[training]\naws_access_key_id = profile-key\naws_secret_access_key = s\n")
    aws_env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    got, _ = _read_epoch(url, gate, _options(gate, profile="training"), tmp_path)
    assert_same_batches(got, reference, "a profile file")
    assert gate.keys_used() == ["profile-key"]


def test_instance_metadata(url, reference, credential_gate, aws_env, tmp_path):
    """Instance metadata (EC2 and EKS node roles) in the training process and each worker. Its
    refresh mid-epoch cannot be shown with keys that live seconds: botocore extends any
    instance-metadata key expiring within its 17-25 minute window (its stability rule for a
    metadata service outage) and refreshes it once that window is reached. The refresh itself
    is botocore's `RefreshableCredentials`, the same object whose refresh the other tests see
    mid-epoch; this test checks the reader holds one."""
    gate = credential_gate(3600.0)
    aws_env.delenv("AWS_EC2_METADATA_DISABLED")
    aws_env.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", gate.url)
    got, _ = _read_epoch(url, gate, _options(gate), tmp_path)
    assert_same_batches(got, reference, "instance metadata")
    keys = gate.keys_used()
    assert gate.refused() == [] and keys and all(key.startswith("ASIAIMDS") for key in keys)
    credentials = s3client.botocore_session(None).get_credentials()
    assert credentials.method == "iam-role" and hasattr(credentials, "refresh_needed")


def test_web_identity_through_sts(url, reference, credential_gate, aws_env,
                                  tmp_path):
    gate = credential_gate(LIFETIME)
    token = tmp_path / "token"
    token.write_text("a-service-account-token")
    aws_env.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    aws_env.setenv("AWS_ROLE_ARN", ROLE)
    aws_env.setenv("AWS_ROLE_SESSION_NAME", "training")
    aws_env.setenv("AWS_ENDPOINT_URL_STS", gate.url)
    got, seconds = _read_epoch(url, gate, _options(gate), tmp_path)
    _assert_refreshed_mid_epoch(gate, got, seconds, reference, "ASIA")


def test_sso_profile(url, reference, credential_gate, aws_env, tmp_path):
    """An IAM Identity Center (SSO) profile, as ``aws configure sso`` and ``aws sso login`` leave
    it: botocore trades the login's token at the SSO portal (the gate) for temporary role
    credentials, again each time they expire. botocore reads that token from
    ``~/.aws/sso/cache``, a path it fixed when it was imported (with this process's HOME):
    pointed at the test's folder for the test."""
    import botocore.credentials

    gate = credential_gate(LIFETIME)
    token_cache = tmp_path / "sso-cache"
    config = write_sso_profile(str(tmp_path), str(token_cache), profile="training")
    aws_env.setattr(botocore.credentials.SSOProvider, "_SSO_TOKEN_CACHE_DIR", str(token_cache))
    aws_env.setenv("AWS_CONFIG_FILE", config)
    aws_env.setenv("AWS_ENDPOINT_URL_SSO", gate.url)
    got, seconds = _read_epoch(url, gate, _options(gate, profile="training"), tmp_path)
    _assert_refreshed_mid_epoch(gate, got, seconds, reference, "ASIASSO")


def test_container_credentials(url, reference, credential_gate, aws_env, tmp_path):
    gate = credential_gate(LIFETIME)
    aws_env.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{gate.url}/__container")
    got, seconds = _read_epoch(url, gate, _options(gate), tmp_path)
    _assert_refreshed_mid_epoch(gate, got, seconds, reference, "ASIACONT")
