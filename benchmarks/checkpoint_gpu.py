"""Checkpoint blocking time with CUDA tensors: shardloader vs DCP async_save; D2H bandwidth.

Skips (exit code 0, a message) when CUDA is not available. For each size, a model-like state of
float32 CUDA tensors is saved `--repeats` times (after a cold save) by:

- limit:       one device-to-host copy of the state into preallocated pinned buffers
- shardloader: Checkpointer.save() (pinned staging pool, reused)
- dcp.async_save: default stager
- dcp.async_save+stager: DefaultStager(pinned, async staging, non-blocking copies); its blocking
               time is until staging completed

and prints medians, ratios to the limit, the effective D2H GB/s of each, and peak extra host
memory (resident high-water mark growth).

    .venv/bin/python benchmarks/checkpoint_gpu.py --sizes 1G,4G
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkpoint import model_like_state, parse_size, reset_peak, rss_kib  # noqa: E402

METHODS = ["limit", "shardloader", "dcp.async_save", "dcp.async_save+stager"]


def d2h_gbps(nbytes: int) -> tuple[float, float]:
    """Device-to-host copy bandwidth into pinned and pageable memory (GB/s)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    out = []
    for pinned in (True, False):
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.append(nbytes / statistics.median(times) / 1e9)
        del dst
    return out[0], out[1]


def bench(method: str, state: dict, repeats: int, workdir: str) -> dict:
    import torch

    size = sum(t.numel() * t.element_size() for t in state.values())
    base = rss_kib()
    reset_peak()
    blocking, complete = [], []
    if method == "limit":
        buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for k, v in state.items():
                buffers[k].copy_(v, non_blocking=True)
            torch.cuda.synchronize()
            blocking.append(time.perf_counter() - t0)
        complete = blocking
        del buffers
    elif method == "shardloader":
        from shardloader.checkpoint import Checkpointer

        class Model:
            def state_dict(self):
                return state

            def load_state_dict(self, s):
                pass

        with Checkpointer(os.path.join(workdir, "ckpt"), keep=1) as ck:
            for i in range(repeats + 1):
                handle = ck.save(i, model=Model())
                blocking.append(handle.timings["blocking_s"])
                handle.wait()
                complete.append(handle.timings["total_s"])
    else:
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        warnings.filterwarnings("ignore")
        stager = None
        if method.endswith("+stager"):
            stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=True))
        for i in range(repeats + 1):
            path = os.path.join(workdir, f"dcp{i}")
            t0 = time.perf_counter()
            if stager is None:
                future = dcp.async_save(state, checkpoint_id=path, no_dist=True)
            else:
                response = dcp.async_save(state, checkpoint_id=path, no_dist=True, async_stager=stager)
                response.staging_completion.result()
                future = response.upload_completion
            blocking.append(time.perf_counter() - t0)
            future.result()
            complete.append(time.perf_counter() - t0)
            shutil.rmtree(path, ignore_errors=True)
        if stager is not None:
            stager.close()
    b = statistics.median(blocking[1:])
    return {"method": method, "bytes": size, "cold_s": blocking[0], "blocking_s": b,
            "complete_s": statistics.median(complete[1:]), "gbps": size / b / 1e9,
            "peak_extra_mib": (rss_kib("VmHWM") - base) / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1G,4G")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("skipped: CUDA is not available on this machine")
        return 0
    pinned, pageable = d2h_gbps(1 << 30)
    print(f"{torch.cuda.get_device_name()}: D2H {pinned:.1f} GB/s pinned, {pageable:.1f} GB/s pageable")
    base = args.dir or tempfile.mkdtemp(prefix="ckpt-gpu-bench-")
    rows = []
    try:
        for size_text in args.sizes.split(","):
            state = {k: v.cuda() for k, v in model_like_state(parse_size(size_text)).items()}
            for method in args.methods.split(","):
                workdir = os.path.join(base, method.replace("+", "_"))
                os.makedirs(workdir, exist_ok=True)
                row = bench(method, state, args.repeats, workdir)
                row["size"] = size_text
                rows.append(row)
                shutil.rmtree(workdir, ignore_errors=True)
            del state
            torch.cuda.empty_cache()
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'size':>5} {'method':22s} {'blocking':>9} {'x limit':>8} {'D2H GB/s':>9} {'cold':>7} "
          f"{'complete':>9} {'peak extra':>11}")
    for size in dict.fromkeys(r["size"] for r in rows):
        group = {r["method"]: r for r in rows if r["size"] == size}
        limit = group.get("limit", {}).get("blocking_s")
        for method, r in group.items():
            ratio = f"{r['blocking_s'] / limit:7.2f}x" if limit else "       -"
            print(f"{size:>5} {method:22s} {r['blocking_s']:8.3f}s {ratio} {r['gbps']:8.1f} "
                  f"{r['cold_s']:6.2f}s {r['complete_s']:8.2f}s {r['peak_extra_mib']:8.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
