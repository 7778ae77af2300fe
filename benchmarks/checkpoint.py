"""How long does a checkpoint block training? shardloader's Checkpointer vs its peers, CPU.

For model-like states (a dict of float32 tensors shaped like transformer layers) of each size,
each method saves `--repeats` times:

- limit:          one copy of the state into preallocated buffers (what any async save must pay);
                  also timed inside every method's process right before each of its saves
- shardloader:    Checkpointer.save() (staging pool reused), then time until complete
- torch.save:     torch.save + fsync to the same disk (blocks for everything)
- dcp.async_save: torch.distributed.checkpoint.async_save, default stager
- dcp.async_save+stager: with DefaultStager(use_async_staging=True); the time that counts is
                  until staging finished (training must not change parameters before that)

All methods run interleaved in one process (round-robin, rotating the order), each save right
after a timing of the copy limit: the machine may be shared, and only figures taken side by side
are compared. Blocking times are medians over repeats after a first (cold) save, which is shown
apart: it pays the one-time allocation of staging memory. Peak extra memory is measured apart,
one process per method (two saves): its resident high-water mark minus its size after building
the state. Writes go to --dir (the same disk for all).

    .venv/bin/python benchmarks/checkpoint.py                 # 256 MiB and 1 GiB, ~3-5 min
    .venv/bin/python benchmarks/checkpoint.py --sizes 4G      # the 4 GiB state (needs ~16 GiB)
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

METHODS = ["limit", "shardloader", "torch.save", "dcp.async_save", "dcp.async_save+stager"]
UNITS = {"M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].upper() in UNITS else int(text)


def model_like_state(nbytes: int):
    """Transformer-like float32 tensors (d=1024 blocks: attention, MLP, norms) totalling ~nbytes."""
    import torch

    d = 1024
    state = {}
    layer = 0
    total = 0
    while total + 12 * d * d * 4 <= nbytes:
        for name, shape in (("attn.qkv.weight", (3 * d, d)), ("attn.out.weight", (d, d)),
                            ("mlp.up.weight", (4 * d, d)), ("mlp.down.weight", (d, 4 * d)),
                            ("attn.qkv.bias", (3 * d,)), ("mlp.up.bias", (4 * d,)),
                            ("norm1.weight", (d,)), ("norm2.weight", (d,))):
            t = torch.empty(shape).fill_(layer + 1)
            state[f"layers.{layer}.{name}"] = t
            total += t.numel() * 4
        layer += 1
    rest = (nbytes - total) // 4
    if rest > 0:
        state["embed.weight"] = torch.empty(rest).fill_(0.5)
    return state


def rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def timing_worker(methods: list[str], nbytes: int, repeats: int, workdir: str) -> list[dict]:
    """All methods in one process, interleaved: each round runs every method once (rotating the
    order), each save right after a timing of the copy limit. The machine is shared, so only
    figures taken side by side are compared."""
    import torch

    state = model_like_state(nbytes)
    size = sum(t.numel() * t.element_size() for t in state.values())
    limit_buffers = {k: torch.empty_like(v) for k, v in state.items()}

    def copy_limit() -> float:
        t0 = time.perf_counter()
        for k, v in state.items():
            limit_buffers[k].copy_(v)
        return time.perf_counter() - t0

    copy_limit()
    savers, extra = {}, {m: {} for m in methods}
    for method in methods:
        os.makedirs(os.path.join(workdir, method), exist_ok=True)
        savers[method] = make_saver(method, state, os.path.join(workdir, method), extra[method])
    cold = {m: savers[m](0)[0] for m in methods}  # allocation of staging memory, page faults
    rec = {m: {"blocking": [], "complete": [], "x_limit": []} for m in methods}
    for r in range(repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for method in order:
            lim = copy_limit()
            b, c = savers[method](r + 1)
            rec[method]["blocking"].append(b)
            rec[method]["complete"].append(c)
            rec[method]["x_limit"].append(b / lim)
            rec[method].setdefault("limit", []).append(lim)
    for saver in savers.values():
        getattr(saver, "close", lambda: None)()
    rows = []
    for method in methods:
        m = rec[method]
        rows.append({
            "method": method, "bytes": size, "tensors": len(state), "repeats": repeats,
            "cold_blocking_s": cold[method],
            "blocking_s": statistics.median(m["blocking"]),
            "limit_s": statistics.median(m["limit"]),
            "x_limit": statistics.median(m["x_limit"]),
            "complete_s": statistics.median(m["complete"]),
            "blocking_all": m["blocking"],
            **extra[method],
        })
    return rows


def memory_worker(method: str, nbytes: int, workdir: str) -> float:
    """Peak extra resident memory (MiB) of two saves with `method`, alone in a process."""
    state = model_like_state(nbytes)
    base = rss_kib()
    reset_peak()
    save = make_saver(method, state, workdir, {})
    save(0)
    save(1)
    getattr(save, "close", lambda: None)()
    return (rss_kib("VmHWM") - base) / 1024


def make_saver(method: str, state: dict, workdir: str, out: dict):
    """A function `save(i) -> (blocking_s, complete_s)` for `method`."""
    import torch

    def fresh(i: int) -> str:
        path = os.path.join(workdir, str(i))
        shutil.rmtree(path, ignore_errors=True)
        return path

    if method == "limit":
        buffers = {k: torch.empty_like(v) for k, v in state.items()}

        def save(i):
            t0 = time.perf_counter()
            for k, v in state.items():
                buffers[k].copy_(v)
            t = time.perf_counter() - t0
            return t, t
        return save

    if method == "shardloader":
        from shardloader.checkpoint import Checkpointer

        ck = Checkpointer(os.path.join(workdir, "ckpt"), keep=1)

        def save(i):
            handle = ck.save(i, model=_Dict(state))
            handle.wait()
            out["phases"] = {k: round(v, 3) for k, v in handle.timings.items()}
            return handle.timings["blocking_s"], handle.timings["total_s"]
        save.close = ck.close
        return save

    if method == "torch.save":
        def save(i):
            path = fresh(i) + ".pt"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            t = time.perf_counter() - t0
            os.unlink(path)
            return t, t
        return save

    if method.startswith("dcp.async_save"):
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        warnings.filterwarnings("ignore")
        stager = None
        if method.endswith("+stager"):
            cuda = torch.cuda.is_available()
            stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=cuda))

        def save(i):
            path = fresh(i)
            t0 = time.perf_counter()
            if stager is None:
                future = dcp.async_save(state, checkpoint_id=path, no_dist=True)
            else:
                response = dcp.async_save(state, checkpoint_id=path, no_dist=True,
                                          async_stager=stager)
                response.staging_completion.result()  # parameters may change only after this
                future = response.upload_completion
            blocked = time.perf_counter() - t0
            future.result()
            done = time.perf_counter() - t0
            shutil.rmtree(path, ignore_errors=True)
            return blocked, done
        if stager is not None:
            save.close = stager.close
        return save
    raise ValueError(method)


class _Dict:
    """Presents a plain dict of tensors as a model (state_dict / load_state_dict)."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state.update(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256M,1G", help="comma separated, e.g. 256M,1G,4G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dir", default=None, help="where checkpoints are written (one disk)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--worker", nargs=4, metavar=("KIND", "METHODS", "BYTES", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, methods, nbytes, workdir = args.worker
        if kind == "time":
            print(json.dumps(timing_worker(methods.split(","), int(nbytes), args.repeats, workdir)))
        else:
            print(json.dumps(memory_worker(methods, int(nbytes), workdir)))
        return

    methods = args.methods.split(",")
    base = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))

    def worker(kind: str, what: str, nbytes: int) -> object:
        workdir = os.path.join(base, "work")
        os.makedirs(workdir, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--repeats", str(args.repeats), "--worker", kind, what,
             str(nbytes), workdir], capture_output=True, text=True, env=env,
        )
        shutil.rmtree(workdir, ignore_errors=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} {what} {nbytes}: failed\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    rows: list[dict] = []
    try:
        for size_text in args.sizes.split(","):
            nbytes = parse_size(size_text)
            peaks = {m: worker("memory", m, nbytes) for m in methods}
            if nbytes * (len(methods) + 1) < 0.6 * available_bytes():
                timed = worker("time", ",".join(methods), nbytes)
            else:  # too large to hold every method's staging memory at once: one at a time
                timed = [worker("time", m, nbytes)[0] for m in methods]
            for row in timed:
                row["size"] = size_text
                row["peak_extra_mib"] = peaks[row["method"]]
                rows.append(row)
                print(f"  {size_text:>5} {row['method']:22s} blocking {row['blocking_s']:.3f}s "
                      f"complete {row['complete_s']:.3f}s peak +{row['peak_extra_mib']:.0f} MiB",
                      file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"\ncheckpoint blocking time, CPU, medians of {rows[0]['repeats'] if rows else '?'} saves "
          "per method after a cold one, methods interleaved in one process.\nx limit: median ratio "
          "to one copy of the state timed just before each save; torch.save/: torch.save's median "
          "blocking over this method's.")
    header = (f"{'size':>5} {'method':22s} {'blocking':>9} {'limit':>7} {'x limit':>8} "
              f"{'torch.save/':>11} {'cold':>7} {'complete':>9} {'peak extra':>11}")
    print(header)
    print("-" * len(header))
    for size in dict.fromkeys(r["size"] for r in rows):
        group = {r["method"]: r for r in rows if r["size"] == size}
        tsave = group.get("torch.save", {}).get("blocking_s")
        for method, r in group.items():
            vs_save = f"{tsave / r['blocking_s']:10.1f}x" if tsave else "          -"
            print(f"{size:>5} {method:22s} {r['blocking_s']:8.3f}s {r['limit_s']:6.3f}s "
                  f"{r['x_limit']:7.2f}x {vs_save} {r['cold_blocking_s']:6.2f}s "
                  f"{r['complete_s']:8.2f}s {r['peak_extra_mib']:7.0f} MiB")
        if "shardloader" in group and "phases" in group["shardloader"]:
            print(f"{'':>5} shardloader phases of the last save (s): {group['shardloader']['phases']}")


if __name__ == "__main__":
    main()
