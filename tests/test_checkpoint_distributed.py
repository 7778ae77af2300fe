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
