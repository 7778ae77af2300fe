"""Which background writer hurts training less: a thread in the training process, or a process?

A training-like loop (a small MLP's forward, backward and optimizer step, plus the Python
overhead of a real loop) runs while a writer writes `--saves` checkpoints of `--size` back to
back with shardloader's writer (`write_part`: stream the staged state from the pool into a
staging file, xxh3-128 from memory, fsync):

- thread:  the writer in a thread of the training process (what Checkpointer does)
- process: the same writer in a separate process, reading the pool from shared memory

The cost of a writer to training is the training time it takes away: the writing window's length
minus the steps done in it times the idle step time, per GiB written. Each mode is repeated in
rotation with idle runs; medians are quoted.

    .venv/bin/python benchmarks/checkpoint_writer.py --size 256M --saves 4 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def staged_state(nbytes: int):
    """A model-like state staged the way Checkpointer.save stages it: (part, pool)."""
    from checkpoint import model_like_state

    from shardloader.checkpoint.staging import StagingPool, plan_rounds, pool_bytes_needed
    from shardloader.checkpoint.tensorfile import encode_header, plan_layout
    from shardloader.checkpoint.writer import StagedPart

    state = list(model_like_state(nbytes).values())
    metas = plan_layout([str(i) for i in range(len(state))], state)
    needed = pool_bytes_needed(metas)
    rounds = plan_rounds(metas, needed)
    pool = StagingPool(pin_memory=False)
    pool.buffer = torch.empty(needed, dtype=torch.uint8).share_memory_()
    pool.copy_in(rounds[0], state)
    return StagedPart("state", metas, rounds, encode_header(metas), b"{}"), pool


def write_loop(part, buffer: torch.Tensor, workdir: str, saves: int, started, done, written) -> None:
    """shardloader's writer (`write_part`), `saves` times into fresh directories, then `done`."""
    import shutil

    from shardloader.checkpoint.staging import StagingPool
    from shardloader.checkpoint.writer import RoundHandoff, write_part

    pool = StagingPool(pin_memory=False)
    pool.buffer = buffer
    started.set()
    for i in range(saves):
        directory = os.path.join(workdir, f"w{os.getpid()}-{i}")
        os.makedirs(directory)
        entries = write_part(directory, part, pool, RoundHandoff(len(part.rounds)))
        shutil.rmtree(directory)
        with written.get_lock():
            written.value += sum(e.bytes for e in entries.values())
    done.set()


class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                         torch.nn.Linear(1024, 512))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, 512)

    def step(self) -> None:
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        _ = [float(p.grad is None) for p in self.model.parameters()]  # loop bookkeeping

    def idle_step_s(self, steps: int) -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def run(mode: str, trainer: Trainer, part, buffer: torch.Tensor, saves: int, workdir: str,
        idle_step: float) -> dict:
    """Train while `saves` checkpoints are written; the training time the writer took away."""
    ctx = mp.get_context("spawn")
    started, done = ctx.Event(), ctx.Event()
    written = ctx.Value("q", 0)
    args = (part, buffer, workdir, saves, started, done, written)
    if mode == "thread":
        worker = threading.Thread(target=write_loop, args=args)
    else:
        worker = ctx.Process(target=write_loop, args=args)
    worker.start()
    if not started.wait(300):
        raise RuntimeError(f"{mode} writer did not start")
    t0 = time.perf_counter()
    steps = 0
    while not done.is_set():
        trainer.step()
        steps += 1
    window = time.perf_counter() - t0
    worker.join()
    gib = written.value / (1 << 30)
    return {"lost_s_per_gib": max(0.0, window - steps * idle_step) / gib,
            "slowdown": window / (steps * idle_step) if steps else float("inf"),
            "writer_gbps": written.value / window / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256M")
    parser.add_argument("--saves", type=int, default=4, help="checkpoints written per run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for training")
    args = parser.parse_args()
    units = {"M": 1 << 20, "G": 1 << 30}
    nbytes = int(args.size[:-1]) * units[args.size[-1].upper()]
    torch.set_num_threads(args.threads)
    part, pool = staged_state(nbytes)
    trainer = Trainer()
    trainer.idle_step_s(20)  # warm up
    results: dict[str, list[dict]] = {"thread": [], "process": []}
    idles = []
    with tempfile.TemporaryDirectory(dir="/tmp") as workdir:
        for r in range(args.rounds):
            for mode in (("thread", "process") if r % 2 == 0 else ("process", "thread")):
                idle = trainer.idle_step_s(100)  # idle right before: the machine may be shared
                idles.append(idle)
                results[mode].append(run(mode, trainer, part, pool.buffer, args.saves, workdir, idle))
    print(f"training while {args.saves} checkpoints of {args.size} are written (write_part: hash + "
          f"fsync), {args.rounds} rounds, torch threads {args.threads}, {os.cpu_count()} cores; "
          f"idle step {statistics.median(idles) * 1e3:.2f} ms")
    print(f"{'writer':8s} {'training s lost per GiB':>24} {'step slowdown':>14} {'writer GB/s':>12}")
    for mode, rows in results.items():
        lost = statistics.median(r["lost_s_per_gib"] for r in rows)
        slow = statistics.median(r["slowdown"] for r in rows)
        gbps = statistics.median(r["writer_gbps"] for r in rows)
        print(f"{mode:8s} {lost:23.3f}s {slow:13.2f}x {gbps:11.2f}")


if __name__ == "__main__":
    main()
