"""Which process owns an MLflow run, and is it still alive?

A training process killed by SIGKILL (preemption, the OOM killer) ends nothing: its run stays
RUNNING in MLflow forever. So every run `MLflowLogger` creates is tagged with its owner (host
name, boot id, pid namespace, pid and the pid's start time), and the next logger that creates a
run in the same experiment on the same machine marks RUNNING runs whose owner is gone as FAILED.
Whether the owner lives is `shardloader.runtime.liveness.is_alive`; the start time (clock ticks
after boot) and the boot id guard against a recycled pid; the pid namespace against another
container on the same host name. Runs from another machine (or another boot, or another pid
namespace) are left alone: their owner cannot be checked from here.
"""

from __future__ import annotations

import os
import socket

from shardloader.runtime.liveness import ProcessIdentity, identity_of, is_alive

TAG_HOST = "shardloader.host"
TAG_PID = "shardloader.pid"
TAG_OWNER = "shardloader.owner"


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_tags(pid: int | None = None) -> dict[str, str]:
    """Tags naming process `pid` (default: this one) as the owner of a run."""
    pid = os.getpid() if pid is None else pid
    host = socket.gethostname()
    start = identity_of(pid).start  # clock ticks after boot; "" where /proc does not know it
    owner = ";".join([
        f"host={host}", f"boot={_read('/proc/sys/kernel/random/boot_id')}",
        f"pidns={_pid_namespace()}", f"pid={pid}", f"start={'' if start is None else start}",
    ])
    return {TAG_HOST: host, TAG_PID: str(pid), TAG_OWNER: owner}


def _parse(owner: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in owner.split(";") if "=" in part)


def owner_is_gone(tags: dict[str, str]) -> bool:
    """True only when the run's owner was on this machine (same host, boot and pid namespace)
    and that process no longer exists; False when it lives or cannot be checked from here."""
    theirs = _parse(tags.get(TAG_OWNER, ""))
    mine = _parse(owner_tags()[TAG_OWNER])
    if not theirs.get("pid", "").isdigit():
        return False
    if any(theirs.get(key) != mine[key] for key in ("host", "boot", "pidns")):
        return False
    start = theirs.get("start", "")
    return not is_alive(ProcessIdentity(int(theirs["pid"]), int(start) if start.isdigit() else None))
