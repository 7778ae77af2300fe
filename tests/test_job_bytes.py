"""A job's data bytes are exact (I15): the README's loop (`tests/job_train.py`) reads a dataset
from the real moto S3 server through the fault proxy with no faults, so that the proxy's count
of the bytes it delivered is the server side's. A first attempt on a cold node cache is
SIGKILLed in its second epoch (every shard was downloaded and read by then), a second resumes
it and finds the cache warm.

What the server delivered is taken from the proxy alone: `bytes_sent` (bodies delivered), split
per request from its log (a ranged GET delivers its range, a plain GET the whole object) and
checked to add up to `bytes_sent` exactly. The only request that is not a shard's is the
dataset's `index.json` (read once per attempt when the Dataset opens, not a cache read): it is
left out of the comparison and accounted for exactly, so every byte the server sent is either
in `bytes.remote_read` or in those index reads. Shard objects are the shards and their range
sidecars (`.ranges`, fetched to read rows by byte range before a shard is whole in the cache).

Cache hits are bytes of shard opens that did not need a download. The expected figure is
derived from the sample order alone (`Loader.step_samples` of a reference loader on the local
copy, the index's shard sizes, and which worker gets which step: round robin from the epoch's
first step): on the cold node nothing is a saving (each shard is opened first by the reader it
was downloaded for); on the warm node each process opens each shard its steps read once (pins
are held for the process's life: one process with num_workers=0, a fresh pair of workers per
epoch with 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from typing import Any

import pytest

from shardloader import Dataset, Loader
from shardloader.telemetry.job.account import account
from shardloader.telemetry.job.read import read_job_dir
from tests.integration_runs import env, survivors
from tests.job_train import write_data

BATCH, SAMPLES, SHARD_SAMPLES, EPOCHS = 32, 640, 64, 2
STEPS_PER_EPOCH = SAMPLES // BATCH
KILL_AT = STEPS_PER_EPOCH + 5  # in the second epoch: every shard was downloaded and opened
RUN_TIMEOUT = 240


def train(tmp_path, root: str, url: str, cache: str, options: dict[str, Any], workers: int,
          *args: str) -> tuple[int, list[int]]:
    """Run the loop once on `url` through the node cache; (exit status, steps printed)."""
    marker = uuid.uuid4().hex
    with open(tmp_path / f"stderr-{marker}", "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.job_train", root, url, "--batch", str(BATCH),
             "--epochs", str(EPOCHS), "--workers", str(workers), "--cache", cache,
             "--storage-options-json", json.dumps(options), *args],
            cwd=tmp_path, env=env(marker), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err, text=True, timeout=RUN_TIMEOUT)
    assert survivors(marker) == [], "a process of the run outlived it"
    if proc.returncode not in (0, -signal.SIGKILL):
        pytest.fail(open(tmp_path / f"stderr-{marker}").read()[-3000:])
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    return proc.returncode, steps


def object_sizes(data: str) -> dict[str, int]:
    """Every file of the local copy by its name under the dataset prefix, and its size."""
    return {name: os.path.getsize(os.path.join(data, name)) for name in os.listdir(data)}


def delivered(entry: Any, size: int) -> int:
    """Body bytes the proxy delivered for one logged GET of an object of `size` bytes."""
    if entry.range is None:
        return size
    assert entry.range.startswith("bytes=") and "," not in entry.range, entry.range
    lo, hi = entry.range[len("bytes="):].split("-")
    return min(int(hi), size - 1) - int(lo) + 1


def served(log: list[Any], sizes: dict[str, int], prefix: str) -> tuple[int, int, list[str]]:
    """(bytes of shard objects, bytes of index.json, the shard objects' names) of `log`; every
    request must be a plain GET of an object of the dataset, without a fault."""
    shard_bytes = index_bytes = 0
    names = []
    for entry in log:
        assert entry.method == "GET" and entry.fault is None, entry
        assert entry.path.startswith(prefix), entry
        name = entry.path[len(prefix):]
        assert name in sizes, entry
        nbytes = delivered(entry, sizes[name])
        if name == "index.json":
            index_bytes += nbytes
        else:
            shard_bytes += nbytes
            names.append(name)
    return shard_bytes, index_bytes, names


def shard_opens(data: str, workers: int, first: int) -> int:
    """Bytes of the shard opens of an attempt on a warm cache that trains from global step
    `first` to the end: per reading process (the training process with num_workers=0; else
    each epoch's workers, which get the epoch's steps round robin from its first), the distinct
    shards its steps read, each opened once (a process keeps its pins while it lives)."""
    with open(os.path.join(data, "index.json")) as f:
        shards = json.load(f)["shards"]
    starts, total = [], 0
    for shard in shards:
        starts.append(total)
        total += shard["samples"]
    assert total == SAMPLES

    def shard_of(sample: int) -> int:
        return max(i for i, start in enumerate(starts) if start <= sample)

    reference = Loader(Dataset(data), batch_size=BATCH, shuffle=True, seed=0)
    single: set[int] = set()
    processes: list[set[int]] = [single] if not workers else []
    for epoch in range(first // STEPS_PER_EPOCH, EPOCHS):
        begin = first % STEPS_PER_EPOCH if epoch == first // STEPS_PER_EPOCH else 0
        epoch_workers: list[set[int]] = [set() for _ in range(workers)]
        processes += epoch_workers
        for k, step in enumerate(range(begin, STEPS_PER_EPOCH)):
            reader = epoch_workers[k % workers] if workers else single
            reader.update(shard_of(int(i)) for i in reference.step_samples(epoch, step))
    reference.close()
    return sum(shards[i]["bytes"] for opened in processes for i in opened)


@pytest.mark.parametrize("workers", [0, 2])
def test_remote_bytes_are_what_s3_served_and_a_warm_restart_reads_no_shard(
        tmp_path, s3_server, s3_url, fault_proxy, workers):
    data = str(tmp_path / "data")
    write_data(data, samples=SAMPLES, shard_samples=SHARD_SAMPLES)
    url = s3_url(data)
    bucket_prefix = "/" + url[len("s3://"):] + "/"
    proxy = fault_proxy(s3_server.endpoint)  # no plan: every request forwarded as it is
    options = s3_server.storage_options(endpoint=proxy.url)
    root, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    sizes = object_sizes(data)
    shard_total = sum(size for name, size in sizes.items() if name != "index.json")  # sidecars too

    rc1, steps1 = train(tmp_path, root, url, cache, options, workers, "--kill-at", str(KILL_AT))
    log1 = proxy.settled()
    sent1 = proxy.bytes_sent
    rc2, steps2 = train(tmp_path, root, url, cache, options, workers)
    log2 = proxy.settled()[len(log1):]
    sent2 = proxy.bytes_sent - sent1
    assert (rc1, rc2) == (-signal.SIGKILL, 0)
    assert steps1 == list(range(1, KILL_AT + 1)) and steps2[-1] == EPOCHS * STEPS_PER_EPOCH

    shards1, index1, names1 = served(log1, sizes, bucket_prefix)
    shards2, index2, names2 = served(log2, sizes, bucket_prefix)
    # The split per request is the proxy's own total, to the byte.
    assert (shards1 + index1, shards2 + index2) == (sent1, sent2)
    assert index1 == index2 == sizes["index.json"]  # one index read per attempt, nothing else
    # The cold attempt asked for no shard object twice: each shard whole once (one downloader
    # per shard on the node) and each range sidecar at most once (an entry of the node cache,
    # fetched by whichever of the training process and its workers needed it first; none for a
    # shard that was whole on the node before anyone read it by range).
    requested = Counter(names1)
    assert set(requested.values()) == {1}, requested
    assert {n for n in requested if n.endswith(".arrow")} == {n for n in sizes if n.endswith(".arrow")}
    assert set(requested) <= {n for n in sizes if n != "index.json"}, requested
    assert shards1 == sum(sizes[n] for n in requested) <= shard_total
    # The warm attempt asked the server for no shard object at all.
    assert names2 == [] and shards2 == 0

    report = account(read_job_dir(root))
    first, second = report["attempts"]
    assert (first["ended"], second["ended"]) == ("killed", "finished")
    assert first["bytes"]["remote_read"] == shards1 == sent1 - index1
    assert second["bytes"]["remote_read"] == 0
    assert report["bytes"]["remote_read"] == proxy.bytes_sent - index1 - index2
    assert report["requests"]["shard_downloads"] == len([n for n in names1 if not n.endswith(".ranges")])

    resumed_from = steps2[0] - 1  # the step of the checkpoint the second attempt restored
    expected_warm = shard_opens(data, workers, resumed_from)
    assert second["bytes"]["cache_hits"] == expected_warm
    if workers == 0:
        # One process: each shard opened once, by the reader it was downloaded for: no saving.
        assert first["bytes"]["cache_hits"] == 0
        assert report["bytes"]["cache_hits"] == expected_warm
    else:
        # Which worker first opens a shard, and whether a worker read a shard's rows by range
        # before it was whole, depend on timing: the cold attempt's hits are bounded only.
        assert first["bytes"]["cache_hits"] <= shard_opens(data, workers, 0) - sum(
            size for name, size in sizes.items() if name.endswith(".arrow"))
    assert report["bytes"]["redownloaded"] == 0
    print(f"workers={workers}: served {sent1} + {sent2} bytes (index {index1} + {index2}); "
          f"remote_read {first['bytes']['remote_read']} + {second['bytes']['remote_read']}; "
          f"cache_hits {first['bytes']['cache_hits']} + {second['bytes']['cache_hits']} "
          f"(resumed from step {resumed_from})")
