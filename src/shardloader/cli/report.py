"""`shardloader report RUN`: where a run's time went, what to change, and a plot.
`shardloader report --job CHECKPOINT_DIR`: the same for a whole job, every attempt together.

RUN is an MLflow run id (metrics written by `MLflowLogger`) or a JSONL telemetry file
(written by `JsonlLogger`). The report is printed as text (or JSON with `--json`); the plot is
written as PNG and, for an MLflow run, logged with the text and JSON as artifacts of the run
under `shardloader-report/` (unless `--no-artifact`).

With --job, CHECKPOINT_DIR is a Checkpointer's root (a local path or any fsspec URL; its `.job/`
holds every attempt's records): the report says where the job's wall time went (productive,
data wait, checkpoint, restore, startup, lost progress, between attempts, other), how each
attempt ended, the samples trained twice or never, the bytes read and written, and the largest
badput with what to change. `--prices gpu_hour=2.5,gpus=8,egress_gb=0.09,get_1k=0.0004,
put_1k=0.005` adds what each kind cost. The timeline plot (one bar per attempt) goes to
`CHECKPOINT_DIR/.job/report.png` for a local directory, or to --plot.

Before reading an MLflow run the tracking server is probed with one short HTTP request
(`--timeout`, 5 s): a server that refuses connections or never answers fails in seconds with a
message naming the URI, instead of MLflow's retry loop (minutes). After the probe, every request
to the server waits at most --timeout (whole seconds) and is not retried, and all of them
together end within --deadline (120 s): a server that dies or stops answering later fails the
command within --timeout of the request it leaves unanswered, and the whole command within
--timeout (probe) + --deadline, with a message naming the server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from shardloader.errors import ShardloaderError
from shardloader.telemetry.records import TelemetryInputError

if TYPE_CHECKING:
    from shardloader.telemetry.mlflow.bounded import BoundedServer


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `report` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "report",
        help="explain where a run's time waiting for data went",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run, report_parser=parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("run", nargs="?", default=None,
                      help="MLflow run id, or path of a JSONL telemetry file")
    what.add_argument("--job", metavar="CHECKPOINT_DIR", default=None,
                      help="report the job whose records are under this checkpoint root")
    parser.add_argument("--prices", type=prices_arg, default=None, metavar="TEXT",
                        help="with --job: prices such as gpu_hour=2.5,gpus=8,egress_gb=0.09,"
                             "get_1k=0.0004,put_1k=0.005")
    parser.add_argument("--storage-option", type=storage_option_arg, action="append",
                        default=None, metavar="KEY=VALUE", dest="storage_option",
                        help="with --job: an fsspec option for a remote CHECKPOINT_DIR "
                             "(repeatable; VALUE is read as JSON when it parses, e.g. anon=true)")
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
    # The defaults are telemetry.mlflow.bounded's REQUEST_TIMEOUT and COMMAND_DEADLINE (not
    # imported here: every `shardloader` command builds this parser).
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds each request to the tracking server waits for an answer, "
                             "not retried (default: 5)")
    parser.add_argument("--deadline", type=float, default=120.0,
                        help="seconds all requests to the tracking server may take together, "
                             "after the probe (default: 120)")


def prices_arg(value: str) -> dict[str, float]:
    """argparse type for --prices (`shardloader.telemetry.job.prices.parse_prices`)."""
    from shardloader.telemetry.job.prices import parse_prices

    try:
        return parse_prices(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def storage_option_arg(value: str) -> tuple[str, Any]:
    """argparse type for --storage-option KEY=VALUE; VALUE as JSON if it parses, else text."""
    key, sep, text = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE")
    try:
        parsed: Any = json.loads(text)
    except json.JSONDecodeError:
        parsed = text
    return key.strip(), parsed


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit status. Unusable input raises ShardloaderError."""
    if getattr(args, "job", None) is not None:
        return run_job(args)
    for flag, key in (("--prices", "prices"), ("--storage-option", "storage_option")):
        if getattr(args, key, None) is not None:
            args.report_parser.error(f"{flag} applies to --job only")
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
            server = check_server(args.tracking_uri, args.timeout, args.deadline)
            records, fields, extra = server.call(
                f"reading run {args.run}", records_from_mlflow,
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
            server.call(f"logging the report to run {args.run}", _log_artifacts,
                        args, tmp, png, text, report)
    print(json.dumps(report, indent=1) if args.json else text, end="" if not args.json else "\n")
    if plot_path:
        print(f"plot: {plot_path}", file=sys.stderr)
    return 0


def run_job(args: argparse.Namespace) -> int:
    """`report --job`: read the job's records, account them, print the text (or JSON), plot."""
    from shardloader.io.paths import is_local, strip_file_scheme
    from shardloader.telemetry.job.account import account
    from shardloader.telemetry.job.read import job_dir_of, read_job_dir
    from shardloader.telemetry.job.render import plot_job, render_job_text

    options = dict(args.storage_option) if args.storage_option else None
    records = read_job_dir(args.job, storage_options=options)
    try:
        report = account(records, prices=args.prices)
    except ValueError as e:  # records that read.py let through but do not add up
        raise TelemetryInputError(f"{job_dir_of(args.job)}: {e}") from None
    plot_path, unwritten = args.plot, "not written (CHECKPOINT_DIR is not local: give --plot PATH)"
    if plot_path is None and is_local(args.job):
        plot_path = os.path.join(strip_file_scheme(job_dir_of(args.job)), "report.png")
    if plot_path is not None:
        try:
            plot_job(report, plot_path)
        except OSError as e:
            if args.plot is not None:
                raise ShardloaderError(f"{plot_path}: cannot write the plot: {e}") from None
            plot_path, unwritten = None, f"not written ({e}; give --plot PATH)"  # a read-only root
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        if plot_path is not None:
            print(f"plot: {plot_path}", file=sys.stderr)
    else:
        print(render_job_text(report) + f"\ntimeline plot: {plot_path or unwritten}\n", end="")
    return 0


def check_server(tracking_uri: str | None, timeout: float,
                 deadline: float = 120.0) -> BoundedServer:
    """Raise TelemetryInputError naming the URI if the tracking server does not answer; else
    the server to make the command's calls through, bounded by `timeout` and `deadline`."""
    import mlflow

    from shardloader.telemetry.mlflow.bounded import BoundedServer
    from shardloader.telemetry.mlflow.probe import probe

    if not timeout > 0 or not deadline > 0:
        raise ShardloaderError(f"--timeout and --deadline must be positive seconds, got "
                               f"{timeout:g} and {deadline:g}")
    uri = tracking_uri or mlflow.get_tracking_uri()
    reason = probe(uri, timeout)
    if reason is not None:
        raise TelemetryInputError(
            f"MLflow tracking server {uri} is not answering: {reason} (is it running? "
            "give its address with --tracking-uri or MLFLOW_TRACKING_URI)")
    return BoundedServer(uri, timeout, deadline)


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
