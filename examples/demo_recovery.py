"""`make demo`, recovery without a human: one automatic restart under torchrun.

Two ranks train (`examples/train_images.py`, gloo) under `torchrun --max-restarts=1`, with the
hung-rank watchdog on. Once a checkpoint is complete, the demo SIGKILLs one rank, and does
nothing else: the torchrun agent stops the other rank and starts the group again, the group
resumes from its newest complete checkpoint (the README's loop) and trains to its end. The
job's account then lists both attempts and how each ended.

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


def automatic_restart(train_args: list[str], checkpoint_dir: str, every: int) -> dict:
    """Run the torchrun job, SIGKILL rank 1 once the save of step 2*`every` has returned (the
    save of step `every` has committed by then: a save waits for the one before), and let the
    agent restart it. Returns what happened: the kill's step, the step the group resumed from,
    seconds from the kill to the resumed group's first step, and the attempts' endings."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", "--nnodes=1",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           os.path.join(ROOT, "examples", "train_images.py"), *train_args,
           "--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(every), "--resume",
           "--announce", "--watchdog", "120"]
    print("$ TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run "
          f"--nproc-per-node={WORLD} --max-restarts=1 ... examples/train_images.py "
          f"--checkpoint-every {every} --resume --watchdog 120 ...  # SIGKILL rank 1 after SAVE {2 * every}",
          flush=True)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
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
        print(f"  attempt {a['id']}  ended {a['ended']:<9} steps {a['steps']:<9} lost {a['lost']}", flush=True)
    return happened
