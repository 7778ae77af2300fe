"""Which process owns an MLflow run, and is it still alive?

A training process killed by SIGKILL (preemption, the OOM killer) ends nothing: its run stays
RUNNING in MLflow forever. So every run `MLflowLogger` creates is tagged with its owner (host
name, boot id, pid namespace, pid and the pid's start time), and the next logger that creates a
run in the same experiment on the same machine marks RUNNING runs whose owner is gone as FAILED.
The start time and the boot id guard against a recycled pid; the pid namespace against another
container on the same host name. Runs from another machine (or another boot, or another pid
namespace) are left alone: their owner cannot be checked from here.
"""

from __future__ import annotations

import os
import socket

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


def process_start(pid: int) -> str:
    """The start time of `pid` in clock ticks since boot ("" where /proc is not available,
    "dead" for a zombie or a pid that does not exist)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        if not os.path.isdir("/proc/self"):
            return ""
        return "dead"
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):  # a zombie: dead, only not yet reaped
        return "dead"
    return fields[19]  # field 22 of stat; fields[0] is field 3


def owner_tags(pid: int | None = None) -> dict[str, str]:
    """Tags naming process `pid` (default: this one) as the owner of a run."""
    pid = os.getpid() if pid is None else pid
    host = socket.gethostname()
    owner = ";".join([
        f"host={host}", f"boot={_read('/proc/sys/kernel/random/boot_id')}",
        f"pidns={_pid_namespace()}", f"pid={pid}", f"start={process_start(pid)}",
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
    pid = int(theirs["pid"])
    start = process_start(pid)
    if start == "dead":
        return True
    if start == "":  # no /proc: only whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return start != theirs.get("start")  # the pid now belongs to another process
