"""Two ranks under torchrun (gloo, CPU): DDP and FSDP2 models saved through DCP with each
rank's loader and RNG state; loaded back by both ranks, then by a single process (world size 1,
DCP reshards); and a one-process checkpoint loaded by both ranks. The scenario itself is
tests/checkpoint_dist_script.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.checkpoint_dist_script import make_single
from tests.fixtures.checkpoint import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "checkpoint_dist_script.py")


def run(cmd: list[str], timeout: float = 240) -> None:
    # This checkout's sources first (not whatever shardloader the interpreter has installed).
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), REPO]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def results(out, mode: str) -> list[dict]:
    found = []
    for name in sorted(os.listdir(out)):
        if name.startswith(f"result-{mode}-"):
            with open(os.path.join(out, name)) as f:
                found.append(json.load(f))
    return found


def test_two_ranks_save_and_load_then_one_process_loads(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    make_single(str(root / "single"), str(out))  # one process; both ranks will load it
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
         SCRIPT, "save", str(root), str(out)])
    ranks = results(out, "save")
    assert [r["ddp"]["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        for kind in ("ddp", "fsdp"):
            got = r[kind]
            assert got["problems"] == [], (kind, got)
            assert got["step"] == 3 and got["latest"] == 3 and got["steps"] == [2, 3]
            assert got["loader_ok"] and got["draws_ok"], (kind, got)
            assert got["note"] == {"rank": r[kind]["rank"]}  # each rank's own extras
            assert got["committed"] == 3
        single = r["single"]
        assert single["problems"] == [] and single["step"] == 1, single
        assert single["loader_position"] == 1
    assert ranks[0]["single"]["warned"]
    payload = ranks[0]["ddp"]["payload"]
    assert payload["file_bytes"] == payload["referenced"], payload  # one replica written, not two
    for kind in ("ddp", "fsdp"):
        newest = max(n for n in os.listdir(root / kind) if n.startswith("step-"))
        names = os.listdir(root / kind / newest)
        assert {"manifest.json", ".metadata", "rank-00000.json", "rank-00001.json"} <= set(names)

    run([sys.executable, SCRIPT, "load1", str(root), str(out)])
    (one,) = results(out, "load1")
    for kind in ("ddp", "fsdp"):
        assert one[kind]["problems"] == [] and one[kind]["step"] == 3, one[kind]
        assert one[kind]["loader_position"] == 3


def torchrun(*args: str) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", SCRIPT, *args])


def test_dcp_checkpoints_never_run_code_and_damage_falls_back(tmp_path):
    """A param_group value whose unpickling would run code is refused at save, naming the key;
    attacked checkpoints (a value replaced by such a pickle, `.metadata` replaced by one, a
    tensor item replaced by garbage; manifest checksums fixed up) are skipped by latest() and
    load() alike on both ranks, which restore the previous checkpoint exactly."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    torchrun("untrusted", str(root), str(out))
    ranks = results(out, "untrusted")
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["refused"] is not None and "hook" in r["refused"] and "Evil" in r["refused"], r
        assert [c["kind"] for c in r["cases"]] == ["value", "metadata", "tensor"]
        for case in r["cases"]:
            assert case["latest"] == case["good"] and case["loaded"] == case["good"], case
            assert case["problems"] == [], case
        assert not r["ran"]
    assert all(c["warned"] for c in ranks[0]["cases"])
    assert not (out / "ran").exists()


def test_save_called_on_rank_0_only_is_a_clear_error_in_bounded_time(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    torchrun("rank0", str(root), str(out))
    rank0, rank1 = results(out, "rank0")
    busy, closed = rank0["busy"], rank0["closed"]
    for got in (busy, closed):
        assert got["error"] is not None, got
        assert "save is collective" in got["error"] and "every rank" in got["error"], got
        assert "rank 1" in got["error"], got
    assert busy["seconds"] < 6 + 10, busy  # the timeout, not the rank's exit
    assert "closed its Checkpointer" in closed["error"] and closed["seconds"] < 30, closed
    for got in (rank0["other"], rank1["other"]):  # each names the other's call, within seconds
        assert got["error"] is not None and "called load(step=None)" in got["error"], got
        assert "called save(step=1)" in got["error"] and got["seconds"] < 30, got
