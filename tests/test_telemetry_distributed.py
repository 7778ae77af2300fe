"""Two ranks under torchrun (gloo): statistics gathered across ranks, and an all_ranks
MLflowLogger whose ranks share rank 0's run and log under their own keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from mlflow import MlflowClient

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from shardloader.telemetry import (BatchRecord, MLflowLogger, StatsAggregator,
                                       aggregate_across_ranks)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out, uri = sys.argv[1], sys.argv[2]
    agg = StatsAggregator()
    logger = MLflowLogger(tracking_uri=uri, experiment="two-ranks", all_ranks=True,
                          fields=("fetch_seconds",))
    for step in range(10):
        record = BatchRecord(step=step, epoch=0, rank=rank, samples=8 + rank,
                             fetch_seconds=0.01 * (rank + 1) + step / 1000, time=100.0 + step,
                             read_seconds=0.0, transform_seconds=0.0,
                             shard_wait_seconds=0.0, queue_depth=0)
        agg.on_batch(record)
        logger.on_batch(record)
    logger.close()
    result = aggregate_across_ranks(agg.summary())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"result": result, "run_id": logger.run_id}, f)
    dist.destroy_process_group()
""")


def test_two_ranks_aggregate_and_log_into_one_run(tmp_path, mlflow_server):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(out), mlflow_server],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"out.json.{r}").read_text()) for r in (0, 1)]
    # Every rank gets the same combined view, with per-rank summaries in rank order.
    assert results[0]["result"] == results[1]["result"]
    result = results[0]["result"]
    assert result["world_size"] == 2
    assert [s["samples"] for s in result["per_rank"]] == [80, 90]
    combined = result["combined"]
    assert combined["batches"] == 20 and combined["samples"] == 170
    assert combined["slowest_rank"] == 1
    assert combined["worst_rank_fetch_seconds_max"] == 0.02 + 9 / 1000
    # One run, shared through rank 0's broadcast; each rank under its own key.
    run_id = results[0]["run_id"]
    assert run_id is not None and results[1]["run_id"] == run_id
    client = MlflowClient(mlflow_server)
    for rank in (0, 1):
        got = {m.step: m.value for m in client.get_metric_history(run_id, f"fetch_seconds/rank{rank}")}
        assert got == {step: 0.01 * (rank + 1) + step / 1000 for step in range(10)}
