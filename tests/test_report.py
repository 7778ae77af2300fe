"""The stall report: cause classification and recommendations on synthetic runs, the text,
the PNG plot, loading from JSONL and from MLflow, and the `report` CLI."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest
from matplotlib.image import imread

from shardloader.cli import main as cli_main
from shardloader.cli import report as cli
from shardloader.telemetry import BatchRecord, JsonlLogger, MLflowLogger, TelemetryInputError
from shardloader.telemetry.analysis import analyse
from shardloader.telemetry.history import records_from_jsonl, records_from_mlflow
from shardloader.telemetry.records import LOGGABLE_FIELDS
from shardloader.telemetry.render import plot, render_text


def scenario(n: int = 200, *, compute: float = 0.02, fetch=lambda i: 0.0, read=0.001,
             transform=0.005, download=0.0, epochs: int = 1, hits=lambda i: 1,
             samples: int = 32) -> list[BatchRecord]:
    """A synthetic run: the loop computes `compute` s per step and waits fetch(i) for batch i."""
    records, t = [], 1_800_000_000.0
    for i in range(n):
        waited = fetch(i)
        t += compute + waited
        epoch = i * epochs // n
        records.append(BatchRecord(
            step=i, epoch=epoch, rank=0, samples=samples, fetch_seconds=waited, time=t,
            read_seconds=read, transform_seconds=transform,
            shard_wait_seconds=download if waited > 0 else 0.0, queue_depth=0 if waited else 2,
            cache_hits=hits(i), cache_misses=1 - hits(i), bytes_downloaded=(1 - hits(i)) * 4_000_000,
        ))
    return records


def test_slow_storage_is_named_with_prefetch_and_cache_advice():
    # Every 4th batch waits 80 ms, and its worker waited 70 ms for a download.
    records = scenario(fetch=lambda i: 0.08 if i % 4 == 0 else 0.0, download=0.07, epochs=2,
                       hits=lambda i: 0 if i % 4 == 0 else 1)
    report = analyse(records)
    assert report["cause"] == "storage"
    a = report["attributed_data_wait_seconds"]
    assert a["storage"] > 5 * a["decode"]
    text = " ".join(report["recommendations"])
    assert "prefetch window" in text
    assert "Later epochs still hit the cache only 75%" in text  # misses persist in epoch 1


def test_slow_decode_is_named_with_a_worker_count():
    # Workers need 95 ms per batch (decode 90 ms); the loop computes 20 ms and waits 30 ms.
    records = scenario(fetch=lambda i: 0.03, read=0.005, transform=0.09, compute=0.02)
    report = analyse(records)
    assert report["cause"] == "decode"
    assert report["step_seconds"] == pytest.approx(0.02, abs=1e-6)
    needed = math.ceil((0.005 + 0.09) / 0.02) + 1
    assert f"Raise num_workers to at least {needed}" in report["recommendations"][0]


def test_fast_pipeline_is_none_and_warmup_is_left_out():
    # A 3 s cold start (first download), then the loader keeps up.
    records = scenario(fetch=lambda i: 3.0 if i == 0 else 0.0002, download=2.9)
    report = analyse(records)
    assert report["cause"] == "none"
    assert report["data_wait_fraction"] > 0.4  # the cold start dominates the raw total...
    assert report["steady_data_wait_fraction"] < 0.05  # ...but not the steady state
    assert report["fetch_seconds"]["max"] == 3.0 and report["fetch_seconds"]["max_step"] == 0
    assert report["slowest"][0]["step"] == 0
    assert "No change needed" in report["recommendations"][0]
    # Counting the cold start in the diagnosis blames storage.
    assert analyse(records, warmup_steps=0)["cause"] == "storage"


def test_wall_time_wait_quantiles_and_order_independence():
    records = scenario(n=100, compute=0.01, fetch=lambda i: 0.001 * (i % 10))
    report = analyse(records)
    wait = sum(r.fetch_seconds for r in records)
    wall = records[-1].time - (records[0].time - records[0].fetch_seconds)
    assert report["wall_seconds"] == pytest.approx(wall)
    assert report["data_wait_seconds"] == pytest.approx(wait)
    assert report["data_wait_fraction"] == pytest.approx(wait / wall)
    assert report["samples_per_second"] == pytest.approx(3200 / wall)
    assert report["fetch_seconds"]["p50"] == pytest.approx(0.0045)
    assert report["fetch_seconds"]["max"] == pytest.approx(0.009)
    assert [row["step"] for row in report["slowest"]] == [9, 19, 29, 39, 49]
    assert analyse(list(reversed(records))) == report


def test_thinned_history_is_scaled_and_missing_fields_are_unknown():
    records = scenario(n=400, compute=0.01, fetch=lambda i: 0.01)
    thinned = records[::10]
    report = analyse(thinned, fields={"fetch_seconds", "samples"})
    assert report["sampled_every"] == 10
    assert report["data_wait_fraction"] == pytest.approx(analyse(records)["data_wait_fraction"], rel=0.01)
    assert report["cause"] == "unknown"
    assert report["worker_seconds_per_batch"]["transform_seconds"] is None
    assert "no worker timings" in report["recommendations"][0]
    with pytest.raises(TelemetryInputError, match="no batch records"):
        analyse([])


def test_text_names_the_numbers_and_the_cause():
    records = scenario(fetch=lambda i: 0.03, transform=0.09)
    report = analyse(records)
    text = render_text(report, title="run x")
    assert text.startswith("run x\n=====\n")
    assert "steps              200 (step 0 .. 199)" in text
    assert "dominant cause     decode" in text
    assert "p95 30.0 ms" in text
    assert text.count("\n  ") >= 6  # five slowest rows + a recommendation


def test_plot_is_a_valid_png(tmp_path):
    records = scenario(fetch=lambda i: 0.5 if i % 50 == 0 else 0.0005)
    path = plot(records, tmp_path / "r.png", title="t")
    data = (tmp_path / "r.png").read_bytes()
    assert path == str(tmp_path / "r.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 300
    assert len(data) < 200_000


def test_jsonl_to_report_and_cli(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    records = scenario(fetch=lambda i: 0.08 if i % 4 == 0 else 0.0, download=0.07)
    sink = JsonlLogger(path)
    for r in records:
        sink.on_batch(r)
    sink.log_metrics({"gpu_idle_seconds": 0.004}, step=10)
    sink.close()
    loaded, extra = records_from_jsonl(path)
    assert loaded == records
    assert extra == {"gpu_idle_seconds": [(10, 0.004)]}
    assert cli_main.main(["report", str(path), "--json", "--plot", str(tmp_path / "p.png")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["cause"] == "storage"
    assert printed["extra"]["gpu_idle_seconds"]["total"] == 0.004
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # Bad input: a clear error naming the file and line, no traceback.
    (tmp_path / "bad.jsonl").write_text('{"kind": "batch"}\n{}\n')
    assert cli_main.main(["report", str(tmp_path / "bad.jsonl")]) == 1
    assert "shardloader report: error: " + str(tmp_path / "bad.jsonl") + ":1: batch record lacks" \
        in capsys.readouterr().err


def test_register_adds_the_subcommand():
    parser = argparse.ArgumentParser(prog="shardloader")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", "abc", "--tracking-uri", "sqlite:///x.db", "--rank", "1"])
    assert args.func is cli.run and args.run == "abc" and args.rank == 1


def test_mlflow_run_report_reads_back_and_logs_artifacts(mlflow_local_store, tmp_path, capsys):
    from mlflow import MlflowClient

    records = scenario(fetch=lambda i: 0.03, transform=0.09)
    # Artifacts go under tmp_path, not MLflow's default ./mlruns in the working directory.
    MlflowClient(mlflow_local_store).create_experiment(
        "report", artifact_location=(tmp_path / "artifacts").as_uri())
    logger = MLflowLogger(tracking_uri=mlflow_local_store, experiment="report",
                          fields=LOGGABLE_FIELDS)
    for r in records:
        logger.on_batch(r)
    logger.log_metrics({"gpu_idle_seconds": 0.002}, step=5)
    logger.close()
    loaded, fields, extra = records_from_mlflow(logger.run_id, mlflow_local_store)
    # MLflow timestamps are milliseconds; everything else comes back exactly.
    assert [r.step for r in loaded] == [r.step for r in records]
    assert [r.fetch_seconds for r in loaded] == [r.fetch_seconds for r in records]
    assert [r.transform_seconds for r in loaded] == [r.transform_seconds for r in records]
    assert [r.epoch for r in loaded] == [r.epoch for r in records]
    assert [r.time for r in loaded] == [int(r.time * 1000) / 1000 for r in records]
    assert "shard_wait_seconds" in fields and extra == {"gpu_idle_seconds": [(5, 0.002)]}
    assert cli_main.main(["report", logger.run_id, "--tracking-uri", mlflow_local_store]) == 0
    out = capsys.readouterr().out
    assert "dominant cause     decode" in out
    client = MlflowClient(mlflow_local_store)
    names = sorted(a.path for a in client.list_artifacts(logger.run_id, "shardloader-report"))
    assert names == ["shardloader-report/report.json", "shardloader-report/report.png",
                     "shardloader-report/report.txt"]
    png = client.download_artifacts(logger.run_id, "shardloader-report/report.png", str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert cli_main.main(["report", "0" * 32, "--tracking-uri", mlflow_local_store]) == 1
    assert f"shardloader report: error: MLflow run {'0' * 32}" in capsys.readouterr().err


@pytest.mark.parametrize("server", ["refusing", "silent"])
def test_cli_fails_fast_naming_a_server_that_does_not_answer(server, request):
    uri = (request.getfixturevalue("dead_tracking_uri") if server == "refusing"
           else request.getfixturevalue("hanging_tracking_server").url)
    env = dict(os.environ, MLFLOW_TRACKING_URI="")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "shardloader.cli.main", "report", "0" * 32, "--tracking-uri", uri],
        capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-2000:]
    reason = "connection refused" if server == "refusing" else "no answer within 5 s"
    assert f"MLflow tracking server {uri} is not answering: {reason}" in proc.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s"  # start-up and imports included
