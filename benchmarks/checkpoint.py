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

--remote: the destination the asynchronous design exists for, a slow one. Each method saves to
s3:// on moto's S3 server (benchmarks/_s3.py, its own process, 127.0.0.1) through the tests'
FaultProxy with an upload cap (`upload_bandwidth`, one proxy per cap, shared by every
connection of the save), a model-like state plus the weights of a small CPU training loop:

- shardloader:     Checkpointer(s3 root).save(): blocking until it returns, then until the
                   handle is done (checkpoint whole at the destination, manifest last)
- torch.save+put:  torch.save to a local file (fsync), then s3fs put_file: one blocking step
- dcp.async_save:  torch.distributed.checkpoint.async_save with torch's own FsspecWriter
                   straight to s3:// (no local staging), default stager

After each save returns, the training loop steps until the save is complete: the steps made,
and their share of what the loop makes alone in that time (timed just before the save), show
whether training goes on during the upload. Then, per async method, a save is called while the
previous one is in flight: shardloader keeps one in flight (on_busy="wait": the second save
blocks until the first is whole), DCP starts a second upload (a second staged copy in memory).
Caps and methods are interleaved round-robin in one process (order rotating); medians over
repeats after a cold save. The S3 server is a Python process on the same cores, so on a small,
shared machine it may itself be slower than the cap: torch.save+put's put time is printed, the
loopback's real rate under the cap, next to the cap's own time.

    .venv/bin/python benchmarks/checkpoint.py --remote --sizes 256M --caps 100M   # ~3 min
    .venv/bin/python benchmarks/checkpoint.py --remote --sizes 1G,4G --caps 100M,25M  # full
    Where all methods and caps do not fit in memory together (`remote_memory`), each cap and
    method runs in a worker of its own, in turn; a pair in flight that does not fit is skipped
    and says so; a size that does not fit even so is refused before it starts. The server
    completes uploads from its parts' files (`benchmarks._s3`): moto's own completion held
    ~4.5x the object in memory, so a 4 GiB state did not fit beside it on a 24 GiB machine.
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
    parser.add_argument("--sizes", default=None,
                        help="comma separated, e.g. 256M,1G,4G (default 256M,1G; --remote: 256M)")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (--remote: 3)")
    parser.add_argument("--methods", default=None,
                        help=f"default {','.join(METHODS)} (--remote: {','.join(REMOTE_METHODS)})")
    parser.add_argument("--remote", action="store_true",
                        help="save to s3:// (moto, 127.0.0.1) behind upload caps instead")
    parser.add_argument("--caps", default="100M",
                        help="--remote: upload caps in bytes/s, comma separated, e.g. 100M,25M")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (one disk)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--worker", nargs=4, metavar=("KIND", "METHODS", "BYTES", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, methods, nbytes, workdir = args.worker
        if kind == "remote":
            caps = [parse_rate(c) for c in args.caps.split(",")]
            print(json.dumps(remote_worker(methods.split(","), int(nbytes), args.repeats, workdir,
                                           caps)))
        elif kind == "time":
            print(json.dumps(timing_worker(methods.split(","), int(nbytes), args.repeats, workdir)))
        else:
            print(json.dumps(memory_worker(methods, int(nbytes), workdir)))
        return
    if args.remote:
        remote_main(args)
        return
    args.repeats = 5 if args.repeats is None else args.repeats
    methods = (args.methods or ",".join(METHODS)).split(",")
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
        for size_text in (args.sizes or "256M,1G").split(","):
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


# -- remote destination: s3:// behind an upload cap -------------------------------------------

REMOTE_METHODS = ["shardloader", "torch.save+put", "dcp.async_save"]


def parse_rate(text: str) -> float:
    """'100M' -> 100e6 bytes/s (decimal, as link speeds are quoted)."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper())
    return float(text[:-1]) * scale if scale else float(text)


class _Trainer:
    """A small CPU training loop (an MLP, SGD) that stands for training going on while a
    checkpoint uploads; its steps/s alone are timed next to each save. Its steps are mostly
    matrix products (which release the GIL), as a GPU step mostly waits on kernels: a loop of
    tiny Python-bound steps would starve any upload thread of the GIL instead."""

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        d = 512
        self.model = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(),
                                         torch.nn.Linear(d, d))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, d)
        self.y = torch.randn(64, d)

    def step(self) -> None:
        self.opt.zero_grad()
        loss = ((self.model(self.x) - self.y) ** 2).mean()
        loss.backward()
        self.opt.step()

    def rate(self, seconds: float = 0.5) -> float:
        """Steps per second alone, over `seconds`."""
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
        return n / (time.perf_counter() - t0)

    def until(self, done) -> int:
        """Step until `done()`; the number of steps made."""
        n = 0
        while not done():
            self.step()
            n += 1
        return n


def remote_worker(methods: list[str], nbytes: int, repeats: int, workdir: str,
                  caps: list[float]) -> list[dict]:
    """Every method saves the same state to s3:// on a moto server behind each upload cap,
    interleaved (round-robin over caps and methods, the order rotating). After each save
    returns, the training loop steps until that save is complete; then the next save."""
    from benchmarks._s3 import S3Process

    state = model_like_state(nbytes)
    trainer = _Trainer()
    state.update({f"trained.{k}": v for k, v in trainer.model.state_dict().items()})
    size = sum(t.numel() * t.element_size() for t in state.values())
    with S3Process({}, upload_caps=caps) as server:
        savers, extra = {}, {}
        for cap in caps:
            for m in methods:
                extra[cap, m] = {}
                savers[cap, m] = make_remote_saver(m, state, server.capped[cap],
                                                   f"cap{int(cap)}/{m}", workdir, extra[cap, m])
        rec = {key: {"blocking": [], "complete": [], "steps": [], "kept": [], "alone": []}
               for key in savers}
        cold = {}
        for r in range(repeats + 1):  # round 0: the cold saves
            for cap in caps:
                order = methods[r % len(methods):] + methods[: r % len(methods)]
                for m in order:
                    alone = trainer.rate()
                    save = savers[cap, m]
                    t0 = time.perf_counter()
                    done = save(r)
                    blocked = time.perf_counter() - t0
                    steps = trainer.until(done)
                    save.finish()
                    complete = time.perf_counter() - t0
                    print(f"    {size >> 20} MiB cap {cap / 1e6:.0f} MB/s {m:16s} round {r}: "
                          f"blocking {blocked:.2f}s complete {complete:.2f}s steps {steps}",
                          file=sys.stderr, flush=True)
                    if r == 0:
                        cold[cap, m] = blocked
                        continue
                    g = rec[cap, m]
                    g["blocking"].append(blocked)
                    g["complete"].append(complete)
                    g["steps"].append(steps)
                    g["alone"].append(alone)
                    upload = complete - blocked
                    g["kept"].append(steps / (alone * upload) if upload > 0.01 else 0.0)
        nxt = {}
        for cap in caps:  # a save called while the previous one is still in flight
            for m in methods:
                if m == "torch.save+put":
                    continue
                # free memory the pair needs beyond what is resident. The Checkpointer reuses
                # its pool and keeps one save in flight: the server receives one upload at a
                # time. DCP stages each save in fresh memory and uploads both at once (before
                # the server completed uploads on disk, 2 GiB OOM-killed it here, stop 35)
                need = (SERVER_BYTES if m == "shardloader" else 2 * SERVER_BYTES + 2 * size)
                free = available_bytes()
                if free < need:
                    nxt[cap, m] = {"next_skipped": f"needs {need / 2**30:.1f} GiB free, "
                                                   f"{free / 2**30:.1f} GiB were"}
                    continue
                save = savers[cap, m]
                t0 = time.perf_counter()
                save(repeats + 1)
                first = time.perf_counter() - t0
                t1 = time.perf_counter()
                done = save(repeats + 2)
                second = time.perf_counter() - t1
                trainer.until(done)
                save.finish()
                nxt[cap, m] = {"next_first_blocking_s": first, "next_blocking_s": second,
                               "next_complete_s": time.perf_counter() - t0,
                               **extra[cap, m].pop("next", {})}
        for saver in savers.values():
            saver.close()
    rows = []
    for (cap, m), g in rec.items():
        rows.append({
            "method": m, "cap": cap, "bytes": size, "repeats": repeats,
            "cold_blocking_s": cold[cap, m],
            "blocking_s": statistics.median(g["blocking"]),
            "complete_s": statistics.median(g["complete"]),
            "steps": statistics.median(g["steps"]),
            "steps_per_s_alone": statistics.median(g["alone"]),
            "train_kept": statistics.median(g["kept"]),
            "complete_all": g["complete"],
            **nxt.get((cap, m), {}), **extra[cap, m],
        })
    return rows


def make_remote_saver(method: str, state: dict, endpoint, prefix: str, workdir: str, out: dict):
    """`save(i) -> done` (a callable: is the save complete?) for `method`, to
    s3://bench/<prefix> through `endpoint` (an S3Endpoint). `save.finish()` waits for (and
    checks) the last save and removes what older ones left; `save.close()` at the end."""
    import fsspec
    import torch

    # s3fs's default read timeout (15 s) is shorter than moto's completion of a large multipart
    # upload on a loaded machine (35 s seen for 1 GiB on 2 shared cores); the client's repeat
    # of the completion then collides with the first one in moto (which is not idempotent
    # there, as it is on S3) and the save fails. The same longer timeout for every method.
    opts = endpoint.fsspec_options()
    opts["config_kwargs"] = {"read_timeout": 600}
    url = endpoint.url(prefix)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    local = os.path.join(workdir, prefix.replace("/", "_"))
    os.makedirs(local, exist_ok=True)

    if method == "shardloader":
        from shardloader.checkpoint import Checkpointer

        ck = Checkpointer(url, keep=1, storage_options=opts,
                          staging_dir=os.path.join(local, "staging"))
        handles = []

        def save(i):
            handles.append(ck.save(i, model=_Dict(state)))
            if len(handles) == 2:  # the second of a pair saved back to back
                out["next"] = {"next_busy_wait_s": handles[1].timings.get("busy_wait_s", 0.0)}
            return handles[-1].done

        def finish():
            for h in handles:
                h.wait()
            out["phases"] = {k: round(v, 3) for k, v in handles[-1].timings.items()}
            handles.clear()
        save.finish, save.close = finish, ck.close
        return save

    if method == "torch.save+put":
        uploaded = []

        def save(i):
            path = os.path.join(local, f"{i}.pt")
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            t1 = time.perf_counter()
            fs.put_file(path, f"{url}/{i}.pt")
            out.setdefault("put_all", []).append(time.perf_counter() - t1)
            out.setdefault("write_all", []).append(t1 - t0)
            uploaded.append((path, f"{url}/{i}.pt"))
            return lambda: True

        def finish():  # outside the timing: drop the local file, keep the last upload
            os.unlink(uploaded[-1][0])
            while len(uploaded) > 1:
                fs.rm_file(uploaded.pop(0)[1])

        save.finish, save.close = finish, lambda: None
        return save

    if method == "dcp.async_save":
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        warnings.filterwarnings("ignore")
        futures, written = [], []

        def save(i):
            writer = FsspecWriter(f"{url}/{i}", **opts)
            futures.append(dcp.async_save(state, storage_writer=writer, no_dist=True))
            written.append(f"{url}/{i}")
            return futures[-1].done

        def finish():
            for f in futures:
                f.result()
            futures.clear()
            while len(written) > 1:  # keep the last, as the Checkpointer's keep=1 does
                fs.rm(written.pop(0), recursive=True)

        save.finish, save.close = finish, lambda: None
        return save
    raise ValueError(method)


#: Memory moto's server holds for one upload in flight, whatever its size: the parts being
#: received (the client sends several at once) and their request bodies until the collector
#: frees them (`benchmarks._s3`). It completes an upload from its parts' files, on disk
#: (`_s3._complete_uploads_on_disk`); moto's own completion held ~4.5x the object. Measured
#: (anonymous memory, sampled every 0.5 s): a 1 GiB `put_file`, 4.5 GB before and 0.9 GB with
#: it; the 4 GiB Checkpointer saves, 1.7 GB (results.md, stop 36).
SERVER_BYTES = 2 * 2**30


def remote_memory(methods: list[str], caps: int, nbytes: int) -> float:
    """Memory one remote worker and the server need at most, in bytes, for `methods` behind
    `caps` caps: the state, one staging pool per Checkpointer (one per cap), two staged copies
    per DCP saver (the pair in flight), and the server receiving two uploads at once."""
    copies = 1
    copies += caps if "shardloader" in methods else 0
    copies += 2 if "dcp.async_save" in methods else 0
    return copies * nbytes + 2 * SERVER_BYTES


def remote_groups(caps: str, methods: list[str], nbytes: int) -> list[tuple[str, list[str]]]:
    """The (caps, methods) of each worker process: one worker for all, interleaved, where they
    fit in memory (0.9 of what is available), else one worker per cap and method, in turn.
    Exits, saying why, where one method alone does not fit: an OOM kill minutes into the run
    is the alternative (the 4 GiB state on a 24 GiB machine)."""
    available = 0.9 * available_bytes()
    each_cap = caps.split(",")
    if remote_memory(methods, len(each_cap), nbytes) <= available:
        return [(caps, methods)]
    for m in methods:
        need = remote_memory([m], 1, nbytes)
        if need > available:
            raise SystemExit(
                f"checkpoint --remote: a {nbytes / 2**30:.1f} GiB state with {m} needs about "
                f"{need / 2**30:.1f} GiB (the state, its staging, and the S3 server's "
                f"{2 * SERVER_BYTES / 2**30:.1f} GiB for two uploads in flight), and "
                f"{available / 2**30:.1f} GiB are available: not run")
    return [(cap, [m]) for cap in each_cap for m in methods]


def remote_main(args) -> None:
    methods = args.methods.split(",") if args.methods else REMOTE_METHODS
    repeats = args.repeats if args.repeats is not None else 3
    base = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-", dir="/tmp")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), root]))
    rows: list[dict] = []
    try:
        for size_text in (args.sizes or "256M").split(","):
            nbytes = parse_size(size_text)
            for caps, group in remote_groups(args.caps, methods, nbytes):
                workdir = os.path.join(base, "work")
                os.makedirs(workdir, exist_ok=True)
                proc = subprocess.run(
                    [sys.executable, __file__, "--repeats", str(repeats), "--caps", caps,
                     "--worker", "remote", ",".join(group), str(nbytes), workdir],
                    stdout=subprocess.PIPE, text=True, env=env)
                shutil.rmtree(workdir, ignore_errors=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"remote {size_text} {caps} {group}: failed "
                                       f"({proc.returncode})")
                for row in json.loads(proc.stdout.strip().splitlines()[-1]):
                    row["size"] = size_text
                    row["interleaved"] = len(group) > 1
                    rows.append(row)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print_remote_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def print_remote_table(rows: list[dict]) -> None:
    n = rows[0]["repeats"] if rows else "?"
    together = ("interleaved in one process" if all(r.get("interleaved", True) for r in rows)
                else "interleaved in one process where they fit in memory, else one process each")
    print(f"\ncheckpoint to s3:// (moto on 127.0.0.1) behind an upload cap (the tests' FaultProxy, "
          f"upload_bandwidth), CPU; medians of {n} saves per method after a cold one, methods and "
          f"caps {together}.\nblocking: save() until it returns; complete: until "
          "the checkpoint is whole at the destination (training steps meanwhile); MB/s: bytes / "
          "complete; steps: training steps made between the two; kept: those steps over what "
          "the loop makes alone in that time; vs torch.save+put: its median over this method's.")
    header = (f"{'size':>5} {'cap':>8} {'method':16s} {'blocking':>9} {'vs t.s+put':>10} "
              f"{'cold':>7} {'complete':>9} {'vs t.s+put':>10} {'MB/s':>6} {'steps':>6} "
              f"{'kept':>5}")
    print(header)
    print("-" * len(header))
    for size in dict.fromkeys(r["size"] for r in rows):
        for cap in dict.fromkeys(r["cap"] for r in rows if r["size"] == size):
            group = {r["method"]: r for r in rows if r["size"] == size and r["cap"] == cap}
            ref = group.get("torch.save+put")
            for m, r in group.items():
                vb = f"{ref['blocking_s'] / r['blocking_s']:9.1f}x" if ref else "         -"
                vc = f"{ref['complete_s'] / r['complete_s']:9.2f}x" if ref else "         -"
                print(f"{size:>5} {cap / 1e6:4.0f}MB/s {m:16s} {r['blocking_s']:8.2f}s {vb} "
                      f"{r['cold_blocking_s']:6.2f}s {r['complete_s']:8.2f}s {vc} "
                      f"{r['bytes'] / r['complete_s'] / 1e6:6.1f} {r['steps']:6.0f} "
                      f"{r['train_kept']:5.2f}")
            if ref and "put_all" in ref:
                print(f"{'':>5} {'':>8} torch.save+put: write {statistics.median(ref['write_all']):.2f}s"
                      f" + put {statistics.median(ref['put_all']):.2f}s; the cap alone: "
                      f"{ref['bytes'] / cap:.2f}s; training alone "
                      f"{ref['steps_per_s_alone']:.0f} steps/s")
            for m, r in group.items():
                if "next_skipped" in r:
                    print(f"{'':>5} {'':>8} next save while one is in flight, {m}: not run "
                          f"({r['next_skipped']})")
                if "next_blocking_s" in r:
                    busy = (f", of which waiting for the one in flight {r['next_busy_wait_s']:.2f}s"
                            if "next_busy_wait_s" in r else "")
                    print(f"{'':>5} {'':>8} next save while one is in flight, {m}: blocks "
                          f"{r['next_blocking_s']:.2f}s{busy} (the first of the pair "
                          f"{r['next_first_blocking_s']:.2f}s; both complete after "
                          f"{r['next_complete_s']:.2f}s)")
            if "shardloader" in group and "phases" in group["shardloader"]:
                print(f"{'':>5} {'':>8} shardloader phases of the last save (s): "
                      f"{group['shardloader']['phases']}")


if __name__ == "__main__":
    main()
