"""`make demo`, recovery without a human: a preemption notice, then an automatic restart.

Two ranks train (`examples/train_images.py`, gloo) under `torchrun --max-restarts=1`, with the
hung-rank watchdog and preemption notices on (`Checkpointer(preemption=...)`).

1. Preemption: a few steps past the first checkpoint the demo SIGTERMs the torchrun agent, as
   Kubernetes or a spot machine's shutdown would. The agent passes it to both ranks; they agree
   on a step, save it, commit it and exit 75: 0 steps lost.
2. The job is started again (what a scheduler's requeue does) and resumes at the preempted step.
   Once a later checkpoint is complete the demo SIGKILLs one rank, and does nothing else: the
   agent stops the other rank and starts the group again, which resumes from its newest
   complete checkpoint (the README's loop) and trains to its end.

The job's account then lists the three attempts and how each ended.

`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: the ranks host their own TCPStore each start; with the
agent's shared store torch 2.13's restarted group fails to connect (docs/checkpoint.md,
"Automatic restarts and hung ranks").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of the agent's child that runs rank `rank` (its environment says RANK=rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) != agent:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    return None


def _torchrun(train_args: list[str], checkpoint_dir: str, every: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", "--nnodes=1",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           os.path.join(ROOT, "examples", "train_images.py"), *train_args,
           "--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(every), "--resume",
           "--announce", "--watchdog", "120", "--preemption", "25"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)


def preemption_notice(train_args: list[str], checkpoint_dir: str, every: int) -> dict:
    """Run the torchrun job and SIGTERM its agent once step `every` + 3 is done (past the first
    checkpoint, between saves). Returns the step the ranks saved on the notice (None if they
    did not say), seconds from the signal to the agent's exit, and the agent's exit status."""
    at = every + 3
    print("$ TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run "
          f"--nproc-per-node={WORLD} --max-restarts=1 ... examples/train_images.py "
          f"--checkpoint-every {every} --resume --watchdog 120 --preemption 25 ...  "
          f"# SIGTERM to the agent after STEP {at}", flush=True)
    agent = _torchrun(train_args, checkpoint_dir, every)
    assert agent.stdout is not None
    happened: dict = {"saved": None, "notice_seconds": None}
    sent = 0.0
    for line in agent.stdout:
        line = line.strip()
        if not sent and line == f"STEP {at}":
            agent.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            print(f"  SIGTERM to the torchrun agent (pid {agent.pid}) after step {at}", flush=True)
        elif sent and line.startswith("PREEMPTED "):
            happened["saved"] = int(line.split()[1])
    happened["exit_code"] = agent.wait()
    if sent:
        happened["notice_seconds"] = time.monotonic() - sent
    print(f"  both ranks saved step {happened['saved']} and exited; the agent exited "
          f"{happened['exit_code']}, {happened['notice_seconds'] or float('nan'):.1f} s after the "
          "signal", flush=True)
    return happened


def automatic_restart(train_args: list[str], checkpoint_dir: str, every: int) -> dict:
    """Run the torchrun job, SIGKILL rank 1 once the save of step 2*`every` has returned (the
    save of step `every` has committed by then: a save waits for the one before), and let the
    agent restart it. Returns what happened: the kill's step, the step the group resumed from,
    seconds from the kill to the resumed group's first step, and the attempts' endings."""
    print("$ TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run "
          f"--nproc-per-node={WORLD} --max-restarts=1 ... examples/train_images.py "
          f"--checkpoint-every {every} --resume --watchdog 120 --preemption 25 ...  "
          f"# started again; SIGKILL rank 1 after SAVE {2 * every}", flush=True)
    agent = _torchrun(train_args, checkpoint_dir, every)
    assert agent.stdout is not None
    happened: dict = {"killed_at": None, "resumed_from": None, "restart_seconds": None}
    killed = 0.0
    for line in agent.stdout:
        line = line.strip()
        if happened["killed_at"] is None and line == f"SAVE {2 * every}":
            pid = _rank_pid(agent.pid, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed, happened["killed_at"] = time.monotonic(), 2 * every
                print(f"  rank 1 (pid {pid}) SIGKILLed after the save of step {2 * every}; "
                      "the agent takes it from here", flush=True)
        elif killed and line.startswith("[rank 0] resumed at step"):
            happened["resumed_from"] = int(line.rsplit(" ", 1)[1])
        elif killed and happened["restart_seconds"] is None and happened["resumed_from"] is not None \
                and line.startswith("STEP "):
            happened["restart_seconds"] = time.monotonic() - killed
            print(f"  restarted by torchrun, resumed from step {happened['resumed_from']}: "
                  f"{happened['restart_seconds']:.1f} s from the kill to the next step", flush=True)
    happened["exit_code"] = agent.wait()
    job = json.loads(subprocess.run(
        [sys.executable, "-m", "shardloader.cli.main", "report", "--job", checkpoint_dir, "--json"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    happened["attempts"] = [{"id": a["id"], "ended": a["ended"], "steps": f"{a['first_step']}..{a['last_step']}",
                             "lost": a["lost_steps"]} for a in job["attempts"]]
    for a in happened["attempts"]:
        print(f"  attempt {a['id']}  ended {a['ended']:<15} steps {a['steps']:<9} lost {a['lost']}",
              flush=True)
    return happened
