"""``tap-upr-gateway verify LEFT RIGHT``: reconcile two captures on Spark."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from gateway.tools.verify.inputs import INSTALL_HINT

EXIT_AGREE = 0
EXIT_DISAGREE = 1
EXIT_INPUT = 2


def _paragraphs(text: str) -> str:
    """Help text wrapped per paragraph (the raw formatter keeps the blank lines between)."""
    return "\n\n".join(textwrap.fill(p, 79) for p in text.split("\n\n"))


def _conf(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("left", metavar="LEFT", help="capture directory or URI (e.g. TAP view)")
    parser.add_argument("right", metavar="RIGHT", help="capture directory or URI (e.g. UPR view)")
    parser.add_argument(
        "--master",
        help="Spark master: local[*] (default), local[N], spark://HOST:PORT, yarn, ... "
        "(under spark-submit, spark-submit's)",
    )
    parser.add_argument("--report", metavar="FILE", help="write the JSON report here")
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="write the report as one self-contained HTML page here (summary, mismatches and "
        "in-flight changes per vbucket, latency distribution, first mismatching records)",
    )
    parser.add_argument(
        "--mismatches", metavar="DIR", help="write every mismatching record as Parquet here"
    )
    parser.add_argument(
        "--partitions",
        type=_positive,
        help="shuffle partitions (default 2 x cores, at least 4 and one per segment file)",
    )
    parser.add_argument(
        "--left-direction",
        choices=("received", "sent"),
        help="only LEFT's records of this direction",
    )
    parser.add_argument(
        "--right-direction",
        choices=("received", "sent"),
        help="only RIGHT's records of this direction",
    )
    parser.add_argument(
        "--samples", type=_positive, default=20, help="sample mismatches per check in the report"
    )
    parser.add_argument("--driver-memory", default="4g", help="Spark driver memory (local mode)")
    parser.add_argument(
        "--conf",
        type=_conf,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Spark setting (repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    parser.set_defaults(handler=run_verify_command)
    return parser


def add_verify_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="reconcile two captures (e.g. TAP and UPR views) on Spark; exit 0 if they agree",
        description=_paragraphs(
            "Read two capture directories with Spark and compare them per vbucket and key: "
            "final state (live with the same CAS, rev_seqno, flags, expiration and value, or "
            "deleted), keys missing or extra, deletions vs expirations, order within each "
            "stream, snapshot and checkpoint boundaries, and the latency between the sides. "
            "Captures of a live bucket made by one `capture --tap A --upr B` carry a cut per "
            "vbucket: each vbucket is compared up to it, and a difference that comes only "
            "from changes past the cut is reported as in flight (counted and listed, not a "
            "failure). Prints a summary (progress on stderr while Spark runs); --report "
            "writes the whole report as JSON, --html as one self-contained page (no scripts, "
            "nothing fetched) with charts per vbucket and of the latency, and the first "
            "mismatching records.\n\n"
            "Needs the pipeline extra (" + INSTALL_HINT + ") and Java 17 or newer "
            "(java on PATH or JAVA_HOME). Capture files are checked before Spark starts. "
            "On a cluster the job ships its own code to the executors and, unless "
            "PYSPARK_PYTHON or spark.pyspark.python is set, runs them with this interpreter.\n\n"
            "Exit status: 0 the sides agree, 1 they disagree, 2 could not check (bad usage, "
            "missing or foreign capture files, a damaged segment, no pipeline extra or Java)."
        ),
        epilog="examples:\n  tap-upr-gateway verify cap/tap cap/upr --report report.json "
        "--mismatches bad/\n  tap-upr-gateway verify cap/tap cap/upr --html report.html\n"
        "  tap-upr-gateway verify cap/tap cap/upr --master spark://HOST:7077",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return configure_parser(parser)


def run_verify_command(args: argparse.Namespace, spark: Any = None) -> int:
    from gateway.tools.verify.inputs import (
        InputError,
        capture_files,
        check_java,
        check_pipeline,
        writable_file,
    )

    # Everything that can be checked without Spark is, so a bad input is one line in seconds.
    try:
        check_pipeline()
        capture_files(args.left, "LEFT")
        capture_files(args.right, "RIGHT")
        for option, path in (("--report", args.report), ("--html", args.html)):
            if path:
                writable_file(path, option)
        if spark is None:
            check_java()
    except InputError as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return EXIT_INPUT
    try:
        from gateway.tools.verify.html import render_html
        from gateway.tools.verify.job import VerifyConfig, run_verify
        from gateway.tools.verify.report import dumps, summary
    except ImportError as exc:
        print(f"verify: needs the pipeline extra: {INSTALL_HINT}: {exc}", file=sys.stderr)
        return EXIT_INPUT
    config = VerifyConfig(
        left=args.left,
        right=args.right,
        master=args.master,
        report=args.report,
        mismatches=args.mismatches,
        partitions=args.partitions,
        left_direction=args.left_direction,
        right_direction=args.right_direction,
        samples=args.samples,
        driver_memory=args.driver_memory,
        progress=not args.no_progress,
        spark_conf=dict(args.conf),
    )
    try:
        result = run_verify(config, spark)
    except InputError as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except ImportError as exc:
        print(f"verify: needs the pipeline extra: {INSTALL_HINT}: {exc}", file=sys.stderr)
        return EXIT_INPUT
    report = result.report
    for path, text in ((config.report, dumps(report) + "\n"), (args.html, render_html(report))):
        if not path:
            continue
        try:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as exc:
            print(f"verify: cannot write the report {path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_INPUT
    print(summary(report))
    damaged = [d for d in report["diagnostics"] if d["kind"] == "damaged"]
    if damaged:
        print(f"verify: {len(damaged)} damaged capture segments, see above", file=sys.stderr)
        return EXIT_INPUT
    return EXIT_AGREE if report["agree"] else EXIT_DISAGREE


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gateway.tools.verify LEFT RIGHT ...`` (also the spark-submit entry point)."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.tools.verify",
        description="Reconcile two captures on Spark (see `tap-upr-gateway verify --help`).",
    )
    args = configure_parser(parser).parse_args(argv)
    return int(args.handler(args))
