"""`shardloader report RUN`: where a run's time went, what to change, and a plot.

RUN is an MLflow run id (metrics written by `MLflowLogger`) or a JSONL telemetry file
(written by `JsonlLogger`). The report is printed as text (or JSON with `--json`); the plot is
written as PNG and, for an MLflow run, logged with the text and JSON as artifacts of the run
under `shardloader-report/` (unless `--no-artifact`).

Before reading an MLflow run the tracking server is probed with one short HTTP request
(`--timeout`, 5 s): a server that refuses connections or never answers fails in seconds with a
message naming the URI, instead of MLflow's retry loop (minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from shardloader.errors import ShardloaderError
from shardloader.telemetry.records import TelemetryInputError


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `report` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "report",
        help="explain where a run's time waiting for data went",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="MLflow run id, or path of a JSONL telemetry file")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: MLflow's, e.g. $MLFLOW_TRACKING_URI)")
    parser.add_argument("--rank", type=int, default=None,
                        help="rank to report (keys of an all_ranks logger; lowest rank in a JSONL)")
    parser.add_argument("--prefix", default="", help="metric key prefix the logger used")
    parser.add_argument("--plot", default=None, help="where to write the PNG plot")
    parser.add_argument("--no-artifact", action="store_true",
                        help="do not log the report and plot to the MLflow run")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--warmup", type=int, default=1,
                        help="first batches left out of the diagnosis (default: 1)")
    parser.add_argument("--top", type=int, default=5, help="how many slowest batches to list")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the tracking server to answer (default: 5)")


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit status. Unusable input raises ShardloaderError."""
    from shardloader.telemetry.analysis import analyse
    from shardloader.telemetry.history import records_from_jsonl, records_from_mlflow
    from shardloader.telemetry.render import plot, render_text

    is_file = os.path.exists(args.run) or args.run.endswith(".jsonl")
    try:
        if is_file:
            records, extra = records_from_jsonl(args.run)
            ranks = sorted({r.rank for r in records})
            rank = args.rank if args.rank is not None else (ranks[0] if ranks else 0)
            if len(ranks) > 1 and args.rank is None:
                print(f"note: {args.run} holds ranks {ranks}; reporting rank {rank} "
                      "(choose with --rank)", file=sys.stderr)
            records = [r for r in records if r.rank == rank]
            fields = None
            title = f"shardloader report: {args.run} (rank {rank})"
        else:
            check_server(args.tracking_uri, args.timeout)
            records, fields, extra = records_from_mlflow(
                args.run, args.tracking_uri, prefix=args.prefix, rank=args.rank)
            title = f"shardloader report: MLflow run {args.run}" + (
                f" (rank {args.rank})" if args.rank is not None else "")
        report = analyse(records, fields=fields, extra=extra, warmup_steps=args.warmup,
                         top_k=args.top)
    except ShardloaderError:
        raise
    except Exception as e:  # MLflow: unknown run, unreachable server
        if type(e).__module__.startswith("mlflow"):
            raise TelemetryInputError(f"MLflow run {args.run}: {e}") from None
        raise
    text = render_text(report, title=title)
    plot_path = args.plot or (args.run + ".report.png" if is_file else None)
    with tempfile.TemporaryDirectory() as tmp:
        png = plot(records, plot_path or os.path.join(tmp, "report.png"), title=title)
        if not is_file and not args.no_artifact:
            _log_artifacts(args, tmp, png, text, report)
    print(json.dumps(report, indent=1) if args.json else text, end="" if not args.json else "\n")
    if plot_path:
        print(f"plot: {plot_path}", file=sys.stderr)
    return 0


def check_server(tracking_uri: str | None, timeout: float) -> None:
    """Raise TelemetryInputError naming the URI if the tracking server does not answer."""
    import mlflow

    from shardloader.telemetry.mlflow.probe import probe

    uri = tracking_uri or mlflow.get_tracking_uri()
    reason = probe(uri, timeout)
    if reason is not None:
        raise TelemetryInputError(
            f"MLflow tracking server {uri} is not answering: {reason} (is it running? "
            "give its address with --tracking-uri or MLFLOW_TRACKING_URI)")


def _log_artifacts(args: argparse.Namespace, tmp: str, png: str, text: str,
                   report: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    folder = os.path.join(tmp, "shardloader-report")
    os.makedirs(folder)
    shutil.copyfile(png, os.path.join(folder, "report.png"))
    with open(os.path.join(folder, "report.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(folder, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    MlflowClient(args.tracking_uri).log_artifacts(args.run, folder, "shardloader-report")
    print(f"logged shardloader-report/ (report.png, report.txt, report.json) to run {args.run}",
          file=sys.stderr)
