"""The job report as text and as a timeline PNG, from hand-made report objects (the shape of
`shardloader.telemetry.job.account`), and the `report --job` command line."""

from __future__ import annotations

import json
import os

import pytest
from matplotlib.image import imread

from shardloader.cli.main import main
from shardloader.telemetry.job import layout
from shardloader.telemetry.job.counters import Counters
from shardloader.telemetry.job.prices import cost, parse_prices
from shardloader.telemetry.job.render import KINDS, LABELS, plot_job, render_job_text

T0 = 1_800_000_000.0
KIND_ORDER = ("productive", "data_wait", "checkpoint", "restore", "startup", "lost_progress", "other")
PRICES = "gpu_hour=2.5,gpus=8,egress_gb=0.09,get_1k=0.0004,put_1k=0.005"


def _attempt(i: int, ended: str, start: float, seconds: tuple[float, ...], first: int, steps: int,
             lost: int, restored: int | None, committed: int | None) -> dict:
    kinds = dict(zip(KIND_ORDER, seconds, strict=True))
    wall = sum(seconds)
    return {
        "id": f"20270115T08{i:02d}00-0000000{i}", "ended": ended, "error": None,
        "start": T0 + start, "end": T0 + start + wall, "wall_seconds": wall, "ranks": 2,
        "first_step": first, "last_step": first + steps - 1, "steps": steps, "lost_steps": lost,
        "restored_step": restored, "last_committed_step": committed, "seconds": kinds,
        "samples": {"trained": steps * 32, "recomputed": lost * 32 if ended != "finished" else 0},
        "bytes": {"remote_read": 0, "cache_hits": 0, "redownloaded": 0, "checkpoint_written": 0,
                  "cache_peak": 0},
    }


def job_report(*, prices: str | None = None) -> dict:
    """3 attempts of 2 ranks: killed at step 70 (saved at 50), killed at 110 (saved at 100),
    finished at 160; gaps of 20 s and 8 s; rank 1 waits for data 4.5x as long as rank 0."""
    attempts = [
        #                                  prod dw  ckpt rest start lost other
        _attempt(1, "killed", 0.0, (50.0, 8.0, 5.0, 0.0, 10.0, 20.0, 7.0), 1, 70, 20, None, 50),
        _attempt(2, "killed", 120.0, (40.0, 6.0, 5.0, 4.0, 8.0, 10.0, 7.0), 51, 60, 10, 50, 100),
        _attempt(3, "finished", 208.0, (60.0, 8.0, 4.0, 4.0, 8.0, 0.0, 8.0), 101, 60, 0, 100, 160),
    ]
    seconds = {k: sum(a["seconds"][k] for a in attempts) for k in KIND_ORDER}
    seconds["between_attempts"] = 28.0
    report = {
        "job": {"job_id": "ab" * 16, "name": "demo"},
        "wall_seconds": 300.0, "goodput": 0.5, "seconds": seconds,
        "steps": {"trained": 190, "recomputed": 30, "lost": 30},
        "samples": {"trained": 6080, "recomputed": 960, "trained_twice": 0, "never_trained": 0},
        "bytes": {"remote_read": 1_234_000_000, "cache_hits": 5_600_000, "redownloaded": 0,
                  "checkpoint_written": 48_000_000, "cache_peak": 900_000_000},
        "requests": {"shard_downloads": 12, "range_requests": 340, "checkpoint_files": 18},
        "data_wait": {"per_rank": {0: 8.0, 1: 36.0}, "mean": 22.0, "max": 36.0, "max_rank": 1,
                      "epochs": [{"epoch": 0, "max_rank": 1, "max_seconds": 20.0, "mean_seconds": 11.0},
                                 {"epoch": 1, "max_rank": 1, "max_seconds": 16.0, "mean_seconds": 11.0}]},
        "lineage": {"complete": True, "attempts": [a["id"] for a in attempts]},
        "attempts": attempts, "cost": None,
    }
    assert sum(seconds.values()) == report["wall_seconds"]
    if prices:
        report["cost"] = cost(report, parse_prices(prices))
    return report


def flat(text: str) -> str:
    """`text` with runs of white space as one space (the diagnosis is wrapped at 100 columns)."""
    return " ".join(text.split())


def test_text_gives_the_figures_and_names_the_largest_badput():
    text = render_job_text(job_report())
    lines = text.splitlines()
    assert lines[:5] == [
        "job demo (abababababababababababababababab)", "=" * 43,
        "attempts           3 (1 finished, 2 killed)",
        "wall time          300.00 s",
        "goodput            50.0% (150.00 s productive)",
    ]
    assert "where the time went      seconds   % wall" in lines
    assert "  lost progress          30.00 s    10.0%" in lines
    assert "  between attempts       28.00 s     9.3%" in lines
    assert "  total                 300.00 s   100.0%" in lines
    assert "cost" not in text.split("attempts\n", 1)[0].split("% wall")[1]  # no prices, no money
    assert "  20270115T080100-00000001 killed                  1..70     20   100.00 s     8.00 s    10.00 s" in lines
    assert "  20270115T080300-00000003 finished             101..160      0    92.00 s     8.00 s     8.00 s" in lines
    assert "samples            trained 6,080   recomputed 960   trained twice 0   never trained 0" in lines
    assert "bytes              remote read 1.2 GB   cache hits 5.6 MB   redownloaded 0 B" in lines
    assert "                   checkpoint written 48.0 MB   cache peak 900.0 MB" in lines
    assert "requests           shard downloads 12   range requests 340   checkpoint files 18" in lines
    assert "data wait by rank  mean 22.00 s   max 36.00 s (rank 1)" in lines
    assert "  rank 1        36.00 s" in lines
    assert "  epoch 1    rank 1 waited most: 16.00 s (mean 11.00 s)" in lines
    diagnosis = flat(text.split("\ndiagnosis\n", 1)[1])
    assert diagnosis.startswith("- The largest badput is lost progress: 30.00 s (10.0% of wall time).")
    # 2 attempts lost 20 and 10 steps; a step is 180 s / 190 steps; every 15 // 4 = 3 steps.
    assert ("Each of the 2 interrupted attempts lost 15.00 s of steps on average (15.0 steps of "
            "947.4 ms) after its last committed checkpoint. Saving every 3 steps instead would "
            "bound it to about 2.84 s per interruption.") in diagnosis
    assert max(len(line) for line in text.split("\ndiagnosis\n", 1)[1].splitlines()) <= 100


def test_text_with_prices_gives_the_money_per_kind():
    text = render_job_text(job_report(prices=PRICES))
    lines = text.splitlines()
    # 2.5 per GPU hour x 8 GPUs = 0.2/36 per second; egress 1.234 GB x 0.09.
    assert "where the time went      seconds   % wall       cost" in lines
    assert "  productive            150.00 s    50.0%     0.8333" in lines
    assert "  lost progress          30.00 s    10.0%     0.1667" in lines
    assert "  total                 300.00 s   100.0%       1.67" in lines
    assert "cost               total 1.78   badput 0.8333   egress 0.1111   requests 0.0002" in lines
    assert ("prices             gpu_hour=2.5, gpus=8, egress_gb=0.09, get_1k=0.0004, put_1k=0.005 "
            "(in the units of the given prices)") in lines
    assert "The largest badput is lost progress: 30.00 s (10.0% of wall time, cost 0.1667)." \
        in flat(text)


def test_after_a_json_round_trip_the_text_is_the_same():
    report = job_report(prices=PRICES)
    assert render_job_text(json.loads(json.dumps(report))) == render_job_text(report)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "productive"])
def test_each_badput_kind_gets_its_advice(kind):
    report = job_report()
    report["seconds"][kind] += 1000.0
    report["wall_seconds"] += 1000.0
    advice = {"lost_progress": "Saving every 3 steps", "data_wait": "raise num_workers",
              "checkpoint": "on_busy='skip'", "restore": "over 2 restores",
              "startup": "Launch to first batch took", "between_attempts": "(longest gap 20.00 s)",
              "other": "the user's code outside the loop"}
    text = flat(render_job_text(report))
    assert f"The largest badput is {LABELS[kind]}: {report['seconds'][kind]:.2f} s" in text
    assert advice[kind] in text


def test_data_wait_names_the_slowest_rank_only_when_ranks_differ():
    report = job_report()
    report["seconds"]["data_wait"] += 100.0
    report["wall_seconds"] += 100.0
    text = flat(render_job_text(report))
    assert ("Rank 1 waited most (36.00 s against 8.00 s for the least; the most in 2 of 2 epochs)"
            in text)
    report["data_wait"]["per_rank"] = {0: 30.0, 1: 35.0}  # within 20%
    report["data_wait"]["max"] = 35.0
    assert "waited most (" not in flat(render_job_text(report))


def test_a_failed_attempt_and_an_incomplete_lineage_are_said():
    report = job_report()
    report["attempts"][1].update(ended="failed", error="RuntimeError: CUDA error: out of memory")
    report["lineage"]["complete"] = False
    text = render_job_text(report)
    assert "attempts           3 (1 finished, 1 killed, 1 failed)" in text
    assert "  20270115T080200-00000002 failed: RuntimeError: CUDA error: out of memory" in text
    assert "lineage            incomplete" in text


def test_no_badput_says_so():
    report = job_report()
    report["seconds"] = {k: (300.0 if k == "productive" else 0.0) for k in KINDS}
    assert "No badput: every second of the job was productive step time." in render_job_text(report)


@pytest.mark.parametrize("prices", [None, PRICES])
def test_plot_is_a_png_of_the_expected_size(tmp_path, prices):
    report = job_report(prices=prices)
    report["attempts"][1]["ended"] = "failed"
    path = plot_job(report, tmp_path / "job.png")
    data = (tmp_path / "job.png").read_bytes()
    assert path == str(tmp_path / "job.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(path).shape[:2]
    assert (width, height) == (800, 80 * 2 + 44 * 3)  # 10 x (2.0 + 0.55 per attempt) in at 80 dpi
    assert 10_000 < len(data) < 200_000


def test_plot_of_no_attempts_is_an_error(tmp_path):
    report = job_report()
    report["attempts"] = []
    with pytest.raises(ValueError, match="no attempts"):
        plot_job(report, tmp_path / "x.png")


@pytest.mark.parametrize(("argv", "message"), [
    ([], "one of the arguments run --job is required"),
    (["x.jsonl", "--job", "d"], "argument --job: not allowed with argument run"),
    (["x.jsonl", "--prices", "gpu_hour=1"], "--prices applies to --job only"),
    (["x.jsonl", "--storage-option", "anon=true"], "--storage-option applies to --job only"),
    (["--job", "d", "--prices", "gpu_hour=lots"], "argument --prices: price 'gpu_hour': not a number"),
    (["--job", "d", "--storage-option", "anon"], "argument --storage-option: 'anon' is not KEY=VALUE"),
])
def test_cli_argument_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", *argv])
    assert exc.value.code == 2
    assert f"shardloader report: error: {message}" in capsys.readouterr().err


def test_storage_options_are_key_value_with_json_values():
    from shardloader.cli.report import storage_option_arg

    assert storage_option_arg("anon=true") == ("anon", True)
    assert storage_option_arg("endpoint_url=http://h:9000") == ("endpoint_url", "http://h:9000")
    assert storage_option_arg("client_kwargs={\"region_name\": \"x\"}") == \
        ("client_kwargs", {"region_name": "x"})


def test_cli_on_a_directory_without_job_records(tmp_path, capsys):
    assert main(["report", "--job", str(tmp_path)]) == 1
    assert (f"shardloader report: error: {tmp_path}/.job/job.json: no job records here"
            in capsys.readouterr().err)


def _write_rank(attempt_dir: str, values: dict, events: list[dict]) -> None:
    counters = Counters(os.path.join(attempt_dir, layout.rank_file(0, layout.COUNTERS_SUFFIX)),
                        {"rank": 0, "world_size": 1, "positions_per_epoch": 1000,
                         "global_batch_size": 8, **values})
    counters.close()
    with open(os.path.join(attempt_dir, layout.rank_file(0, layout.EVENTS_SUFFIX)), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)


def job_dir(root) -> str:
    """A job of two 1-rank attempts written by hand: the first killed at step 40 (committed at
    30), the second restored from step 30 and finished at step 60."""
    job = root / layout.JOB_DIR
    first, second = job / "attempts" / "20270115T080000-0000000a", job / "attempts" / "20270115T080100-0000000b"
    first.mkdir(parents=True)
    second.mkdir()
    (job / layout.JOB_FILE).write_text(json.dumps(
        {"format": 1, "job_id": "cd" * 16, "name": "by-hand", "created": T0}))
    _write_rank(str(first), {
        "launch_time": T0, "heartbeat_time": T0 + 55, "steps": 40, "positions": 320,
        "first_batch_time": T0 + 5, "first_wait_seconds": 1, "data_wait_seconds": 5,
        "step_seconds": 40, "checkpoint_seconds": 2, "start_cursor": 0, "segment_start": 0,
        "cursor": 320, "epoch": 0, "epoch_data_wait": 5, "bytes_remote": 4_000_000,
        "downloads": 4, "checkpoint_bytes": 1000, "checkpoint_files": 2}, [
        {"event": "start", "time": T0 + 1, "attempt": first.name, "rank": 0, "world_size": 1},
        {"event": "save", "time": T0 + 36, "step": 30, "checkpoint": "step-30", "cursor": 240,
         "steps": 30, "step_seconds": 30.0, "positions": 240},
        {"event": "committed", "time": T0 + 38, "step": 30, "checkpoint": "step-30",
         "bytes": 1000, "files": 2}])
    _write_rank(str(second), {
        "launch_time": T0 + 60, "heartbeat_time": T0 + 99, "steps": 30, "positions": 240,
        "first_batch_time": T0 + 65, "blocked_before_first": 1, "first_wait_seconds": 1,
        "data_wait_seconds": 3, "step_seconds": 30, "restore_seconds": 1, "start_cursor": 240,
        "segment_start": 240, "cursor": 480, "epoch": 0, "epoch_data_wait": 3,
        "bytes_from_cache": 4_000_000}, [
        {"event": "start", "time": T0 + 61, "attempt": second.name, "rank": 0, "world_size": 1},
        {"event": "restore", "time": T0 + 64, "step": 30, "checkpoint": "step-30",
         "seconds": 1.0, "cursor": 240},
        {"event": "end", "time": T0 + 100, "how": "finished", "error": None}])
    return str(root)


def test_cli_reports_a_job_written_by_hand(tmp_path, capsys):
    root = job_dir(tmp_path)
    assert main(["report", "--job", root]) == 0
    out = capsys.readouterr().out
    assert "attempts           2 (1 finished, 1 killed)" in out
    assert "wall time          100.00 s" in out
    assert "goodput            60.0% (60.00 s productive)" in out
    assert "  lost progress          10.00 s    10.0%" in out
    assert ("The largest badput is lost progress: 10.00 s (10.0% of wall time). - The interrupted "
            "attempt lost 10.00 s of steps (10.0 steps of 1.00 s) after its last committed "
            "checkpoint. Saving every 2 steps") in flat(out)
    png = os.path.join(root, ".job", "report.png")
    assert out.endswith(f"\ntimeline plot: {png}\n")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    plot = tmp_path / "elsewhere.png"
    assert main(["report", "--job", root, "--json", "--prices", "gpu_hour=3.6",
                 "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(a["ended"], a["first_step"], a["last_step"], a["lost_steps"])
            for a in report["attempts"]] == [("killed", 1, 40, 10), ("finished", 31, 60, 0)]
    assert report["wall_seconds"] == 100.0
    assert sum(report["seconds"].values()) == pytest.approx(100.0, abs=1e-9)
    assert report["cost"]["compute"]["lost_progress"] == pytest.approx(0.01)  # 10 s at 1 GPU, 3.6/h
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # A plot that cannot be written where asked is an error naming the path.
    assert main(["report", "--job", root, "--plot", str(tmp_path / "no" / "such" / "p.png")]) == 1
    assert f"shardloader report: error: {tmp_path}/no/such/p.png: cannot write the plot" \
        in capsys.readouterr().err
