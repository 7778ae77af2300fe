"""`make demo`: the whole product in a few minutes on a laptop, on embedded defaults.

1. Generates a procedural image-class folder (JPEGs of varied sizes), converts it to Arrow shards
   with `shardloader convert`, and inspects them.
2. Trains a small residual CNN for a while, uninterrupted: the reference.
3. Trains again, SIGKILLs the run without warning mid-training, and resumes it from the newest
   complete checkpoint.
4. Prints throughput, the stall fraction (how long training waited for data), the checkpoint's
   blocking time against `torch.save`, and the verdict: are the final weights of the killed and
   resumed run bit for bit those of the uninterrupted run?
5. Accounts for the killed-and-resumed job across both its attempts (`shardloader report
   --job`): where its wall time went, the steps the kill cost, samples trained twice or never.
6. Recovery without a human: two ranks under `torchrun --max-restarts=1`: a SIGTERM to the agent
   (a preemption notice) makes both save the same step and exit 75, 0 steps lost; started again,
   one rank is SIGKILLed and the agent restarts the group, which resumes and finishes; the job
   account lists the three endings (`demo_recovery`).
7. Checks that no process it started (directly or not: loader workers, the MLflow writer, the
   SIGKILLed run's children) is still alive, and says so; any survivor fails the demo.

Everything lands in ./demo-output (the MLflow store, the stall report and plot, checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid

import torch
from demo_recovery import automatic_restart, preemption_notice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
SHARDLOADER = [PYTHON, "-m", "shardloader.cli.main"]
EXPERIMENT = "shardloader-demo"
# Every process the demo starts inherits this marker in its environment, orphans included, so
# the demo can find them all at the end (Linux: /proc).
DEMO_MARK = "SHARDLOADER_DEMO_RUN"


def marked_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes other than this one whose environment carries
    DEMO_MARK=marker. Zombies (exited, waiting to be reaped) do not count."""
    needle = f"{DEMO_MARK}={marker}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except OSError:
            continue
    return found


def children_of(pid: int) -> list[int]:
    """Pids of every process below `pid` (via /proc parent pids)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(parents.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(parents.get(child, ()))
    return out


def leftover_processes(marker: str, timeout: float = 10.0) -> list[tuple[int, str]]:
    """The demo's processes still alive after up to `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, cwd=ROOT, **kw)


def train_cmd(args: argparse.Namespace, out: str, name: str, extra: list[str]) -> list[str]:
    return [PYTHON, os.path.join(ROOT, "examples", "train_images.py"),
            "--data", os.path.join(out, "shards"), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--crop", "64",
            "--checkpoint-every", str(args.checkpoint_every),
            "--checkpoint-dir", os.path.join(out, f"checkpoints-{name}"),
            "--final", os.path.join(out, f"final-{name}.pt"),
            "--summary", os.path.join(out, f"summary-{name}.json"), *extra]


def killed_and_resumed(args: argparse.Namespace, out: str) -> tuple[int, dict, int]:
    """Start a run, SIGKILL it at a random step past the first checkpoint, resume it. Returns
    the kill step, the resumed run's summary and how many processes the killed run had below it
    (its loader workers, the MLflow writer): the kill leaves them to end on their own."""
    rng = random.Random(args.seed)
    kill_at = rng.randint(args.checkpoint_every + 1, args.steps - 2)
    mlflow = ["--mlflow", args.mlflow, "--experiment", EXPERIMENT]
    cmd = train_cmd(args, out, "resumed", ["--announce", *mlflow])
    print(f"$ {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}  "
          f"# SIGKILL at step {kill_at}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    below = 0
    for line in proc.stdout:
        if line.strip() == f"STEP {kill_at}":
            below = len(children_of(proc.pid))
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"the training run ended with code {proc.returncode} before step {kill_at}")
    print(f"  killed with SIGKILL at step {kill_at} ({below} processes below it left to end on their own)",
          flush=True)
    run(train_cmd(args, out, "resumed", ["--resume", *mlflow]))
    with open(os.path.join(out, "summary-resumed.json")) as f:
        return kill_at, json.load(f), below


def same_state(a: dict, b: dict) -> tuple[bool, int]:
    """Bitwise comparison of two nested state dicts; returns (equal, tensors compared)."""
    count = 0

    def walk(x, y) -> bool:
        nonlocal count
        if isinstance(x, torch.Tensor):
            count += 1
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(walk(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(walk(i, j) for i, j in zip(x, y))
        return x == y

    return walk(a, b), count


def torch_save_seconds(state: dict, target: str, repeats: int = 5) -> float:
    """Median blocking time of the usual way: torch.save of `state`, then fsync."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with open(target, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - start)
    os.remove(target)
    return sorted(times)[repeats // 2]


def blocking_at_scale(out: str, mib: int = 256, repeats: int = 5) -> tuple[float, float]:
    """Median blocking seconds of Checkpointer.save vs torch.save+fsync for a model-like state
    of `mib` MiB: the demo's own model is too small for the difference to show."""
    from shardloader.checkpoint import Checkpointer

    state = {f"layer{i}_weight": torch.randn(mib // 16, 1024, 256) for i in range(16)}  # 16 MiB each
    model = torch.nn.Module()
    for name, tensor in state.items():
        model.register_buffer(name, tensor)
    ours = []
    with Checkpointer(os.path.join(out, "checkpoints-scale"), keep=1) as ckpt:
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            ckpt.save(step, model=model)
            ours.append(time.perf_counter() - start)
            ckpt.wait()
    shutil.rmtree(os.path.join(out, "checkpoints-scale"), ignore_errors=True)
    theirs = torch_save_seconds(state, os.path.join(out, "torch-save-scale.pt"), repeats)
    return sorted(ours)[repeats // 2], theirs


def prepare_mlflow(out: str) -> str:
    """A local MLflow store (sqlite) with its artifacts under `out`, like a user's default setup."""
    from mlflow import MlflowClient

    uri = "sqlite:///" + os.path.join(out, "mlflow.db")
    client = MlflowClient(uri)
    if client.get_experiment_by_name(EXPERIMENT) is None:
        client.create_experiment(EXPERIMENT, artifact_location="file://" + os.path.join(out, "mlartifacts"))
    return uri


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "demo-output"))
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=int(os.environ.get("DEMO_SEED", "7")))
    args = p.parse_args()
    out = args.out
    for name in ("checkpoints-reference", "checkpoints-resumed", "checkpoints-recovery",
                 "mlartifacts", "mlflow.db"):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    os.makedirs(out, exist_ok=True)
    args.mlflow = prepare_mlflow(out)
    marker = os.environ[DEMO_MARK] = uuid.uuid4().hex  # inherited by everything started below
    started = time.perf_counter()

    print("\n== 1. data: a generated image folder, converted to shards", flush=True)
    folder, shards = os.path.join(out, "images"), os.path.join(out, "shards")
    if not os.path.exists(os.path.join(shards, "index.json")):
        from shardloader.synthetic import write_image_folder

        write_image_folder(folder, args.images, seed=0)
        run(SHARDLOADER + ["convert", folder, shards, "--shard-samples", "200"])
    run(SHARDLOADER + ["inspect", shards])

    print("\n== 2. the reference: an uninterrupted run", flush=True)
    run(train_cmd(args, out, "reference", []))

    print("\n== 3. the same run, killed without warning and resumed", flush=True)
    kill_at, summary, killed_children = killed_and_resumed(args, out)

    print("\n== 4. the stall report", flush=True)
    report_png = os.path.join(out, "stall-report.png")
    if summary.get("mlflow_run_id"):
        run(SHARDLOADER + ["report", summary["mlflow_run_id"], "--tracking-uri", args.mlflow,
                           "--plot", report_png])

    print("\n== 5. the job's account: both attempts of the killed-and-resumed job", flush=True)
    job_dir, job_png = os.path.join(out, "checkpoints-resumed"), os.path.join(out, "job-report.png")
    run(SHARDLOADER + ["report", "--job", job_dir, "--plot", job_png])
    job = json.loads(subprocess.run(SHARDLOADER + ["report", "--job", job_dir, "--json", "--plot", job_png],
                                    cwd=ROOT, check=True, capture_output=True, text=True).stdout)

    print("\n== 6. recovery without a human: a preemption notice, then torchrun restarts a killed "
          "rank by itself", flush=True)
    recovery_args = ["--data", shards, "--steps", str(3 * args.checkpoint_every), "--batch-size",
                     str(args.batch_size // 2), "--workers", "1", "--crop", "64"]
    recovery_dir = os.path.join(out, "checkpoints-recovery")
    notice = preemption_notice(recovery_args, recovery_dir, args.checkpoint_every)
    restart = automatic_restart(recovery_args, recovery_dir, args.checkpoint_every)
    endings = [a["ended"] for a in restart["attempts"]]
    preempted = (notice["saved"] is not None and endings[:1] == ["preempted_saved"]
                 and restart["attempts"][0]["lost"] == 0)
    restarted = (restart["exit_code"] == 0 and restart["resumed_from"] is not None
                 and endings[1:] == ["killed", "finished"])

    reference = torch.load(os.path.join(out, "final-reference.pt"), weights_only=True)
    resumed = torch.load(os.path.join(out, "final-resumed.pt"), weights_only=True)
    equal, tensors = same_state(reference, resumed)
    loader_stats = summary.get("loader", {})
    ckpt_stats = summary.get("checkpoint", {})
    blocking = ckpt_stats.get("last", {}).get("blocking_s")
    baseline = torch_save_seconds(reference, os.path.join(out, "torch-save.pt"))
    scale_ours, scale_torch = blocking_at_scale(out)

    print("\n== summary", flush=True)
    print(f"throughput            {summary['samples_per_second']:,.0f} samples/s "
          f"(after resume, {args.workers} workers, batch {args.batch_size})")
    if "stall_fraction" in loader_stats:
        print(f"stall                 {100 * loader_stats['stall_fraction']:.1f}% of wall time waiting for data "
              f"(p95 fetch {1e3 * loader_stats.get('fetch_seconds_p95', 0):.1f} ms)")
    if blocking is not None:
        print(f"checkpoint blocking   {1e3 * blocking:.1f} ms per save (model+optimizer+loader+RNG) vs "
              f"torch.save+fsync of model+optimizer {1e3 * baseline:.1f} ms ({baseline / blocking:.1f}x less)")
    print(f"checkpoint at 256 MiB {1e3 * scale_ours:.0f} ms blocking vs torch.save+fsync "
          f"{1e3 * scale_torch:.0f} ms ({scale_torch / scale_ours:.1f}x less)")
    print(f"killed at step        {kill_at} (SIGKILL), resumed from the newest complete checkpoint")
    verdict = "EXACT: identical" if equal else "MISMATCH: different"
    lost = sum(a["lost_steps"] for a in job["attempts"])
    print(f"job account           goodput {100 * job['goodput']:.1f}% of {job['wall_seconds']:.0f} s over "
          f"{len(job['attempts'])} attempts; {lost} steps lost to the kill and recomputed; samples "
          f"trained twice {job['samples']['trained_twice']}, never {job['samples']['never_trained']} "
          f"(timeline: {job_png})")
    print(f"exact resume          {verdict} final weights and optimizer state ({tensors} tensors, torch.equal)")
    print(f"preemption notice     {'OK' if preempted else 'FAILED'}: SIGTERM to torchrun, both ranks "
          f"saved step {notice['saved']} and exited, {notice['notice_seconds'] or float('nan'):.1f} s "
          f"after the signal; steps lost {restart['attempts'][0]['lost'] if restart['attempts'] else '?'}")
    print(f"automatic restart     {'OK' if restarted else 'FAILED'}: rank 1 SIGKILLed at step "
          f"{restart['killed_at']}, torchrun restarted the group with no manual step, resumed "
          f"from step {restart['resumed_from']} "
          f"({restart['restart_seconds'] or float('nan'):.1f} s kill to next step); attempts ended: "
          f"{', '.join(endings)}")
    print(f"MLflow store          {args.mlflow}  (mlflow ui --backend-store-uri {args.mlflow})")
    if os.path.exists(report_png):
        print(f"stall plot            {report_png}")
    left = leftover_processes(marker) if os.path.isdir("/proc") else None
    if left is None:
        print("processes left        not checked (needs Linux /proc)")
    elif not left:
        print(f"processes left        none: every process the demo started has ended, including the "
              f"{killed_children} the SIGKILLed run left behind")
    else:
        print(f"processes left        {len(left)} STILL ALIVE: "
              + "; ".join(f"pid {pid} {cmd[:100]}" for pid, cmd in left))
    print(f"demo took             {time.perf_counter() - started:.0f} s")
    sys.exit(0 if equal and preempted and restarted and not left else 1)


if __name__ == "__main__":
    main()
