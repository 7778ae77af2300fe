"""The cold first batch per S3 credential source, beside mosaicml-streaming with the same
source, and locally beside torch's DataLoader: issue 37's goal table, in one run.

Each try is a fresh interpreter: `torch` and the JPEG decoder imported first (a training script
has them), then the clock runs from building the dataset (`Dataset()`, or the peer's own
dataset) to the first batch out of its loader; a second figure adds the import of what the
loader needs for it: ours imports botocore at its first s3:// read, inside the first figure,
while `import streaming` loads boto3 before it (and ~5 s of transformers and sklearn for its
text datasets, left out), so the second figure adds boto3's import to the peer's (64 samples, 2 workers, shuffled,
decode + random crop 112 + flip: `benchmarks.peers`' settings). S3 is moto's server in a
process of its own (`benchmarks._s3`), with an empty local cache; temporary credentials come
from `benchmarks._credentials`' gate (moto's instance metadata and STS behind it; moto's S3
itself checks no key, so the bytes do not go through the gate: it would add a Python hop to
every request, and more to the loader that makes more of them). Rows:

* keys in the options: shardloader's `storage_options={"key": ..., "secret": ...}`; the peer
  takes them from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (it has no such option);
* profile file: a shared credentials file, its profile named (`profile=` / AWS_PROFILE);
* instance metadata (EC2 and EKS node roles), through the gate (moto's answer, a new key);
* web identity (EKS service accounts): a token file and a role, through moto's STS;
* container credentials (ECS, EKS Pod Identity): AWS_CONTAINER_CREDENTIALS_FULL_URI;
* SSO profile (IAM Identity Center): a profile naming an SSO role and the login's cached token
  (under the children's HOME), traded at the gate's SSO portal.

Both libraries resolve every source through AWS's chain (botocore's, boto3's). The peer reads
MDS shards of the same images, 1,000 a shard as ours. Figures are medians over `--repeats`
rounds, the loaders and sources taking turns within each round; the ratio is ours / the
peer's (goal: <= 1 from S3, <= 1.5 locally against DataLoader).

    .venv-bench/bin/python -m benchmarks.coldstart_sources [--images 4000] [--repeats 3]

(`python -m benchmarks.coldstart --sources` runs the same.) Without mosaicml-streaming (the main
venv) its column says n/a and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS, PEER, LOCAL_PEER = "shardloader", "mosaicml-streaming", "torch DataLoader"
SOURCES = ("keys in the options", "profile file", "instance metadata", "web identity",
           "container credentials", "SSO profile")
ROLE = "arn:aws:iam::123456789012:role/training"


# -- the child: one cold start ----------------------------------------------------------------
def child(spec: dict[str, Any]) -> dict[str, float]:
    """In this fresh process: "batch", seconds from building the dataset to the first batch;
    "with import", the same plus importing what the loader needs for it (torch is imported
    before either: a training script has it): for ours `shardloader` (botocore is imported by
    the first s3:// read, inside "batch"), for the peer boto3, its S3 client (`import streaming`
    loads it, and ~5 s of transformers and sklearn for its text datasets, left out)."""
    import torch  # noqa: F401 - a training script has it imported

    t0 = time.perf_counter()
    from shardloader import Dataset, Loader  # noqa: F401 - botocore comes with the first s3:// read

    library = {OURS: time.perf_counter() - t0, LOCAL_PEER: 0.0}
    from benchmarks import peers
    from benchmarks._images import prepare_images
    from shardloader.runtime.child_process import die_with_parent

    die_with_parent(spec["parent"])
    images = prepare_images(spec["n"], log=lambda _: None)
    peers.Augment("fast")(images.read_jpeg(0))  # the decoder's imports, as in a training script
    if spec["loader"] == PEER:
        t0 = time.perf_counter()
        import boto3  # noqa: F401 - its S3 client, which `import streaming` loads

        library[PEER] = time.perf_counter() - t0
        peers.import_streaming()
    remote = None
    if spec.get("endpoint"):
        remote = peers.Remote(_Through(spec["endpoint"], spec["options"]), spec["cache_dir"])
    if spec["loader"] == OURS:
        peer = peers.shardloader_peer(images, "fast", remote)
    elif spec["loader"] == PEER:
        peer = peers.mosaic_peer(images, "fast", remote)
    else:
        peer = peers.dataloader_peer(images, "fast")
    start = time.perf_counter()
    loader = peer.make()
    next(iter(loader))
    seconds = time.perf_counter() - start
    peer.close(loader)
    return {"batch": seconds, "with import": seconds + library[spec["loader"]]}


class _Through:
    """`benchmarks._s3.S3Endpoint`'s interface, with the storage options of one source."""

    def __init__(self, endpoint: str, options: dict[str, Any]) -> None:
        self.endpoint, self.options = endpoint, options

    def url(self, layout: str) -> str:
        from benchmarks._s3 import BUCKET

        return f"s3://{BUCKET}/{layout}"

    def fsspec_options(self) -> dict[str, Any]:
        return self.options


# -- the parent --------------------------------------------------------------------------------
def source_setup(source: str, s3: str, gate: Any, work: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(shardloader's storage options, the environment of both loaders' processes) for `source`:
    S3 at `s3`, temporary credentials from `gate`."""
    from benchmarks._s3 import KEY, REGION, SECRET

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_CONFIG_FILE": os.path.join(work, "no-config"),
                "AWS_SHARED_CREDENTIALS_FILE": os.path.join(work, "no-credentials"),
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": REGION,
                "S3_ENDPOINT_URL": s3, "PYTHONPATH": ROOT})
    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": s3, "region_name": REGION}}
    if source == "keys in the options":
        options.update(key=KEY, secret=SECRET)
        env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET)  # the peer's only way
    elif source == "profile file":
        path = os.path.join(work, "credentials")
        with open(path, "w") as f:
            f.write(f"[bench]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
        options["profile"] = "bench"
        env.update(AWS_SHARED_CREDENTIALS_FILE=path, AWS_PROFILE="bench")
    elif source == "instance metadata":
        del env["AWS_EC2_METADATA_DISABLED"]
        env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = gate.url
    elif source == "web identity":
        token = os.path.join(work, "token")
        with open(token, "w") as f:
            f.write("a-service-account-token")
        env.update(AWS_WEB_IDENTITY_TOKEN_FILE=token, AWS_ROLE_ARN=ROLE,
                   AWS_ROLE_SESSION_NAME="bench", AWS_ENDPOINT_URL_STS=gate.url)
    elif source == "container credentials":
        env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = f"{gate.url}/__container"
    elif source == "SSO profile":
        from benchmarks._credentials import write_sso_profile

        home = os.path.join(work, "home")
        config = write_sso_profile(work, os.path.join(home, ".aws", "sso", "cache"), profile="bench")
        options["profile"] = "bench"
        env.update(HOME=home, AWS_CONFIG_FILE=config, AWS_PROFILE="bench", AWS_ENDPOINT_URL_SSO=gate.url)
    return options, env


def run_child(spec: dict[str, Any], env: dict[str, str], timeout: float = 300) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.coldstart_sources", "--child",
                           json.dumps(spec)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{spec['loader']} failed: {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peer_missing() -> str | None:
    try:
        from benchmarks import peers

        peers.import_streaming()
    except Exception as e:  # noqa: BLE001 - the column says why
        return f"{type(e).__name__}: {e}"[:160]
    return None


def measure(n: int, repeats: int, log: Any = print) -> dict[str, Any]:
    """{(source or "local", loader): [seconds per round]} and why a column is missing."""
    from benchmarks._common import compile_library
    from benchmarks._credentials import CredentialGate
    from benchmarks._images import prepare_images, prepare_mds
    from benchmarks._s3 import KEY, S3Process

    images = prepare_images(n, log=log)
    compile_library()  # fresh processes import compiled modules, as an installed package's
    missing = peer_missing()
    layouts = {"arrow": images.arrow_dir}
    if missing is None:
        layouts["mds"] = prepare_mds(images, log=log)
    work = tempfile.mkdtemp(prefix="coldstart-sources-", dir=os.path.join(ROOT, "benchmarks", "out"))
    times: dict[str, list[float]] = {}
    loaders = [OURS] + ([PEER] if missing is None else [])
    try:
        with S3Process(layouts) as server:
            gate = CredentialGate(server.at.endpoint, lifetime=3600.0).start()
            gate.allow(KEY)
            try:
                for round_ in range(repeats):
                    for source in SOURCES:
                        options, env = source_setup(source, server.at.endpoint, gate, work)
                        for loader in loaders if round_ % 2 == 0 else loaders[::-1]:
                            cache = tempfile.mkdtemp(dir=work)
                            spec = {"parent": os.getpid(), "n": n, "loader": loader,
                                    "endpoint": server.at.endpoint, "options": options,
                                    "cache_dir": cache}
                            got = run_child(spec, env)
                            shutil.rmtree(cache, ignore_errors=True)
                            _keep(times, f"{source}|{loader}", got)
                            log(f"  round {round_ + 1}: {source}, {loader}: {got['batch']:.2f} s "
                                f"({got['with import']:.2f} s with the import)")
                    for loader in (OURS, LOCAL_PEER) if round_ % 2 == 0 else (LOCAL_PEER, OURS):
                        env = {**os.environ, "PYTHONPATH": ROOT}
                        got = run_child({"parent": os.getpid(), "n": n, "loader": loader}, env)
                        _keep(times, f"local|{loader}", got)
                        log(f"  round {round_ + 1}: local, {loader}: {got['batch']:.2f} s "
                            f"({got['with import']:.2f} s with the import)")
            finally:
                gate.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"times": times, "peer_missing": missing, "n": n,
            "repeats": repeats}


def _keep(times: dict[str, list[float]], key: str, got: dict[str, float]) -> None:
    for what, seconds in got.items():
        times.setdefault(f"{key}|{what}", []).append(seconds)


def render(results: dict[str, Any]) -> str:
    times, missing = results["times"], results["peer_missing"]

    def median(key: str) -> float | None:
        values = times.get(key)
        return statistics.median(values) if values else None

    def cells(key: str, ours: str, theirs: str, goal: float) -> str:
        out = []
        for what in ("batch", "with import"):
            a, b = median(f"{key}|{ours}|{what}"), median(f"{key}|{theirs}|{what}")
            ratio = a / b if a and b else None
            verdict = "n/a" if ratio is None else ("met" if ratio <= goal else "NOT met")
            out.append(f"{_f(a)} | {_f(b)} | {_f(ratio)} {verdict}")
        return " | ".join(out)

    head = ("| {what} | {ours} (s) | {peer} (s) | ratio | {ours}, with imports (s) | "
            "{peer}, with imports (s) | ratio |")
    lines = [f"cold first batch, fresh process, torch imported: construction (Dataset()) to the "
             f"first batch, and with the imports it needs (the S3 client's); {results['n']} images, medians of "
             f"{results['repeats']} rounds; S3: moto on loopback", "",
             f"goal: ours / {PEER} <= 1 per credential source", "",
             head.format(what="source", ours=OURS, peer=PEER), "|-|-|-|-|-|-|-|"]
    for source in SOURCES:
        lines.append(f"| {source} | {cells(source, OURS, PEER, 1.0)} |")
    lines += ["", f"goal: ours / {LOCAL_PEER} <= 1.5 on local files", "",
              head.format(what="local", ours=OURS, peer=LOCAL_PEER), "|-|-|-|-|-|-|-|",
              f"| files on local disk | {cells('local', OURS, LOCAL_PEER, 1.5)} |"]
    if missing:
        lines.append(f"\n{PEER}: n/a ({missing}); run from .venv-bench (`make bench-setup`)")
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    print(render(measure(args.images, args.repeats)))


if __name__ == "__main__":
    main()
