"""Random-row read throughput of Arrow, tar and Parquet shards vs plain individual files.

Writes N samples of random bytes (sizes uniform in [0.5, 1.5] x --size) as: native Arrow
shards, WebDataset tars (indexed, with offset sidecars), Parquet files (row groups of
--row-group rows, indexed in place), and one plain file per sample. Then reads batches of 64
rows through `Dataset.get_many` (what the Loader's workers call), against open()+read() of the
same samples' files, in two access patterns:

* global: 64 rows drawn uniformly from the whole dataset (worst case for shard formats);
* window: 64 rows drawn from a window of 4 shards (the Loader's shard-aware shuffle).

Files are in the page cache (just written, and warmed), so this measures the per-row CPU cost
of each format, not the disk. Parquet is shown twice: with the reader's default decoded
row-group cache (32 MiB per shard: here every shard's row groups fit, so after warm-up nothing
is decoded again, which is the steady state when shards are small), and with a cache of only the
last two row groups (every batch decodes the row groups it touches: the cost for large shards). Each figure is the median of --repeats runs. A second table gives
the cost of opening one shard (tar: with its sidecar vs by scanning the headers).

Run: .venv/bin/python benchmarks/read_rows.py  [--n 20000 --size 10240 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import machine, table  # noqa: E402
from shardloader import Dataset, write_shards  # noqa: E402
from shardloader.format.registry import open_shard  # noqa: E402
from shardloader.format.tar import scan_tar, sidecar_path  # noqa: E402
from shardloader.ingest.indexer import index_dataset  # noqa: E402

BATCH = 64
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "read_rows")


def make_payloads(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(size // 2, size + size // 2 + 1, size=n)
    blob = rng.bytes(int(sizes.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [blob[offsets[i]:offsets[i + 1]] for i in range(n)]


def prepare(root: str, payloads: list[bytes], per_shard: int, row_group: int) -> dict[str, str]:
    """Write every layout under `root`; returns layout name -> folder."""
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    samples = [{"data": p, "label": i % 10} for i, p in enumerate(payloads)]
    dirs = {name: os.path.join(root, name) for name in ("arrow", "tar", "parquet", "files")}
    write_shards(samples, dirs["arrow"], shard_samples=per_shard)
    write_shards(samples, dirs["tar"], shard_samples=per_shard, format="tar")
    os.makedirs(dirs["parquet"])
    for part, start in enumerate(range(0, len(samples), per_shard)):
        chunk = payloads[start:start + per_shard]
        t = pa.table({"data": pa.array(chunk, pa.binary()),
                      "label": pa.array([i % 10 for i in range(start, start + len(chunk))], pa.int64())})
        pq.write_table(t, os.path.join(dirs["parquet"], f"part-{part:05d}.parquet"),
                       row_group_size=row_group, compression="none")
    index_dataset(dirs["parquet"])
    for i, p in enumerate(payloads):
        folder = os.path.join(dirs["files"], f"{i // 1000:04d}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i:08d}.bin"), "wb") as f:
            f.write(p)
    return dirs


def batches(pattern: str, n: int, per_shard: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    shards = (n + per_shard - 1) // per_shard
    for _ in range(count):
        if pattern == "global":
            out.append(rng.integers(0, n, size=BATCH))
        else:  # a window of 4 consecutive shards of a shuffled shard order
            first = int(rng.integers(0, max(1, shards - 3)))
            lo, hi = first * per_shard, min(n, (first + 4) * per_shard)
            out.append(rng.integers(lo, hi, size=BATCH))
    return out


def files_reader(folder: str) -> Callable[[np.ndarray], list[bytes]]:
    def read(rows: np.ndarray) -> list[bytes]:
        out = []
        for i in rows.tolist():
            with open(os.path.join(folder, f"{i // 1000:04d}", f"{i:08d}.bin"), "rb") as f:
                out.append(f.read())
        return out
    return read


def dataset_reader(folder: str, parquet_cache_bytes: int | None = None
                   ) -> Callable[[np.ndarray], list[bytes]]:
    ds = Dataset(folder, max_open_shards=1 << 16)
    ds.get_many(np.arange(0, len(ds), 97))  # open and verify every shard outside the timing
    if parquet_cache_bytes is not None:  # shrink the decoded row-group cache of each reader
        for reader in ds._readers.values():
            reader.cache_bytes = parquet_cache_bytes
            reader._cache.clear()

    def read(rows: np.ndarray) -> list[bytes]:
        return [r["data"] for r in ds.get_many(rows)]

    read.close = ds.close  # type: ignore[attr-defined]
    return read


def measure(read: Callable[[np.ndarray], list[bytes]], work: list[np.ndarray],
            payloads: list[bytes], repeats: int, seconds: float = 1.0) -> tuple[float, float]:
    """Median rows/s and MB/s over `repeats` passes over `work` (cut to about `seconds` per
    pass for slow layouts); checks the bytes first."""
    start = time.perf_counter()
    for rows, got in zip(work[:5], map(read, work[:5])):
        assert got == [payloads[i] for i in rows.tolist()], "benchmark read wrong bytes"
    per_batch = (time.perf_counter() - start) / 5
    work = work[:max(5, min(len(work), int(seconds / per_batch)))]
    nbytes = sum(len(payloads[i]) for rows in work for i in rows.tolist())
    nrows = sum(len(rows) for rows in work)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for rows in work:
            read(rows)
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    return nrows / t, nbytes / t / 1e6


def open_costs(dirs: dict[str, str], repeats: int) -> list[list[object]]:
    rows = []
    for name in ("arrow", "tar", "parquet"):
        ds = Dataset(dirs[name])
        info = ds.index.shards[0]
        path = os.path.join(dirs[name], info.path)

        def open_close(info=info, path=path, schema=ds.index.schema) -> None:
            open_shard(info, path, schema).close()

        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            open_close()
            times.append(time.perf_counter() - start)
        label = f"{name} (sidecar)" if name == "tar" else name
        rows.append([label, info.samples, statistics.median(times) * 1e3])
        if name == "tar":
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                scan_tar(path)
                times.append(time.perf_counter() - start)
            rows.append(["tar (header scan)", info.samples, statistics.median(times) * 1e3])
            assert os.path.exists(sidecar_path(path))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="samples")
    parser.add_argument("--size", type=int, default=10_240, help="mean sample bytes")
    parser.add_argument("--per-shard", type=int, default=1_000, help="samples per shard")
    parser.add_argument("--row-group", type=int, default=128, help="Parquet rows per row group")
    parser.add_argument("--batches", type=int, default=150,
                        help="batches of 64 per repeat (fewer for layouts slower than 1 s per pass)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()

    start = time.perf_counter()
    payloads = make_payloads(args.n, args.size, seed=0)
    dirs = prepare(args.out, payloads, args.per_shard, args.row_group)
    print(f"machine: {machine()}")
    print(f"data: {args.n} samples, mean {args.size} B, {args.per_shard} per shard, "
          f"Parquet row groups of {args.row_group} rows (written in {time.perf_counter() - start:.1f} s)")
    readers = {
        "plain files": files_reader(dirs["files"]),
        "arrow": dataset_reader(dirs["arrow"]),
        "tar": dataset_reader(dirs["tar"]),
        "parquet": dataset_reader(dirs["parquet"]),
        "parquet, 2 row groups cached": dataset_reader(dirs["parquet"], parquet_cache_bytes=0),
    }
    for pattern in ("global", "window"):
        work = batches(pattern, args.n, args.per_shard, args.batches, seed=1)
        results = {name: measure(read, work, payloads, args.repeats) for name, read in readers.items()}
        base = results["plain files"][0]
        rows = [[name, rps, mbs, rps / base] for name, (rps, mbs) in results.items()]
        print(f"\nrandom batches of {BATCH} rows, pattern '{pattern}', median of {args.repeats}:")
        print(table(["layout", "rows/s", "MB/s", "x plain files"], rows))
    print(f"\nopening one shard (median of {args.repeats}):")
    print(table(["shard", "samples", "ms"], open_costs(dirs, args.repeats)))
    for read in readers.values():
        close = getattr(read, "close", None)
        if close is not None:
            close()
    del readers
    if not args.keep:
        shutil.rmtree(args.out, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
