"""``tap-upr-gateway capture``: record a TAP and/or UPR endpoint's streams to segment files."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from adapters.errors import GatewayError
from gateway.cli.security_args import (
    add_client_tls_options,
    add_password_file_option,
    client_tls_from,
    password_from_file,
)
from gateway.cli.startup import StartupError, describe
from gateway.runtime import logs
from gateway.tools.capture.cut import DEFAULT_CUT_TIMEOUT, TwoSidedResult, capture_both
from gateway.tools.capture.session import (
    DEFAULT_BUFFER_SIZE,
    CaptureOptions,
    CaptureResult,
)

DIALECTS = ("dcp", "upr-draft")


def _address(text: str) -> tuple[str, int]:
    from gateway.io.listen import parse_hostport

    try:
        return parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _vbuckets(text: str) -> tuple[int, ...]:
    try:
        out: list[int] = []
        for part in text.split(","):
            first, _, last = part.partition("-")
            out.extend(range(int(first), int(last or first) + 1))
        return tuple(out)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a vbucket list such as 0,1,5-9"
        ) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _paragraphs(text: str) -> str:
    """Help text wrapped per paragraph (the raw formatter keeps the blank lines between)."""
    return "\n\n".join(textwrap.fill(p, 79) for p in text.split("\n\n"))


EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_USAGE = 2


def add_capture_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "capture",
        help="record every vbucket of a TAP and/or UPR endpoint to capture segments",
        description=_paragraphs(
            "Connect to a TAP or UPR endpoint (a node or the gateway) and record, without "
            "translating, a full backfill of every active vbucket and then live changes, as "
            "msgpack records in size-rotated segment files under --out. Stops on SIGTERM or "
            "Ctrl-C (closing the segments cleanly), or with --until-caught-up once every "
            "vbucket reached the high seqno it had at start.\n\n"
            "With both --tap and --upr it records the two views at once, into --out/tap and "
            "--out/upr, and stops both at one cut: per vbucket the furthest CAS either side "
            "had recorded after the initial catch-up (--until-caught-up) or when asked to stop "
            "(Ctrl-C); both keep recording until each reached it, then a CUT record per "
            "vbucket goes into each capture. `verify` compares two captures up to their cut.\n\n"
            "Exit status: 0 the stop condition was reached with every record written; "
            "1 records were dropped or could not be written (e.g. --out unwritable), or the "
            "capture ended before its stop condition (the server closed or refused it, the cut "
            "was not reached within --cut-timeout); 2 bad usage."
        ),
        epilog="examples:\n  tap-upr-gateway capture --tap 127.0.0.1:11212 --upr 127.0.0.1:11213 "
        "--out cap --until-caught-up\n"
        "  tap-upr-gateway capture --upr 127.0.0.1:11210 --out cap/upr --until-caught-up",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tap", type=_address, metavar="HOST:PORT", help="a TAP endpoint")
    parser.add_argument("--upr", type=_address, metavar="HOST:PORT", help="a UPR endpoint")
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="directory for the segments (with --tap and --upr: DIR/tap and DIR/upr)",
    )
    parser.add_argument(
        "--dialect", choices=DIALECTS, default="dcp", help="UPR dialect (default dcp)"
    )
    parser.add_argument(
        "--until-caught-up",
        action="store_true",
        help="stop once every vbucket reached the high seqno seen at start "
        "(both sides: take the cut then)",
    )
    parser.add_argument(
        "--cut-timeout",
        type=_positive,
        default=int(DEFAULT_CUT_TIMEOUT),
        metavar="SECONDS",
        help=f"both sides: how long to wait for each to reach the cut "
        f"(default {DEFAULT_CUT_TIMEOUT:g})",
    )
    parser.add_argument("--user", help="SASL PLAIN user")
    parser.add_argument(
        "--password",
        default="",
        help="SASL PLAIN password (visible to other users in ps: prefer "
        "--password-file or $TAP_UPR_GATEWAY_PASSWORD)",
    )
    parser.add_argument("--name", help="connection name (default capture-SIDE-HOST-PORT)")
    parser.add_argument(
        "--vbuckets",
        type=_vbuckets,
        metavar="LIST",
        help="only these vbuckets, e.g. 0-3,9 (default all active)",
    )
    parser.add_argument(
        "--buffer-size",
        type=_positive,
        default=DEFAULT_BUFFER_SIZE,
        metavar="BYTES",
        help=f"UPR connection_buffer_size (default {DEFAULT_BUFFER_SIZE})",
    )
    parser.add_argument(
        "--segment-mb",
        type=_positive,
        default=64,
        metavar="MIB",
        help="rotate segments at this size (MiB, default 64)",
    )
    add_client_tls_options(parser, "the endpoints")
    add_password_file_option(parser)
    logs.add_logging_options(parser)
    parser.set_defaults(handler=run_capture)
    return parser


def _options(args: argparse.Namespace, side: str, out: Path) -> CaptureOptions:
    host, port = getattr(args, side)
    return CaptureOptions(
        host=host,
        port=port,
        out=out,
        until_caught_up=args.until_caught_up,
        user=args.user,
        password=args.password,
        name=args.name,
        vbuckets=args.vbuckets,
        dialect=args.dialect,
        buffer_size=args.buffer_size,
        max_segment_bytes=args.segment_mb * 1024 * 1024,
        ssl_context=client_tls_from(args),
    )


def options_from(args: argparse.Namespace) -> tuple[str, CaptureOptions]:
    """The side and options of a one-sided capture."""
    side = "tap" if args.tap else "upr"
    return side, _options(args, side, args.out)


def two_sided_options(args: argparse.Namespace) -> tuple[CaptureOptions, CaptureOptions]:
    return _options(args, "tap", args.out / "tap"), _options(args, "upr", args.out / "upr")


Runner = Callable[..., Awaitable[CaptureResult]]


async def run_until_stopped(runner: Runner, options: CaptureOptions) -> CaptureResult:
    """Run a capture; SIGINT/SIGTERM stop it cleanly (segments flushed and closed)."""
    async with trio.open_nursery() as nursery:
        result: CaptureResult = await nursery.start(_run_then_cancel, runner, options, nursery)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                result.stopped = "stopped"
                nursery.cancel_scope.cancel()
                break
    return result


async def _run_then_cancel(
    runner: Runner,
    options: CaptureOptions,
    nursery: trio.Nursery,
    *,
    task_status: trio.TaskStatus[CaptureResult],
) -> None:
    await runner(options, task_status=task_status)
    nursery.cancel_scope.cancel()  # done: stop listening for signals


async def run_both_until_cut(
    tap: CaptureOptions, upr: CaptureOptions, *, until_caught_up: bool, cut_timeout: float
) -> TwoSidedResult:
    """Both sides to one cut; the first SIGINT/SIGTERM takes the cut, a second stops at once."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        result: TwoSidedResult = await nursery.start(
            _both_then_cancel, tap, upr, until_caught_up, cut_timeout, stop, nursery
        )
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if stop.is_set():
                    result.stopped = "stopped before the cut was reached"
                    nursery.cancel_scope.cancel()
                    break
                stop.set()
    return result


async def _both_then_cancel(
    tap: CaptureOptions,
    upr: CaptureOptions,
    until_caught_up: bool,
    cut_timeout: float,
    stop: trio.Event,
    nursery: trio.Nursery,
    *,
    task_status: trio.TaskStatus[TwoSidedResult],
) -> None:
    await capture_both(
        tap,
        upr,
        until_caught_up=until_caught_up,
        stop=stop,
        cut_timeout=cut_timeout,
        task_status=task_status,
    )
    nursery.cancel_scope.cancel()


def _check_out(out: Path) -> str | None:
    """Why ``out`` cannot take segments, or ``None``."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "exists and is not a directory"
    except OSError as exc:
        return f"cannot create it: {exc.strerror or exc}"
    if not os.access(out, os.W_OK | os.X_OK):
        return "not writable"
    return None


def _incomplete(result: CaptureResult, until: bool) -> str | None:
    """Why a finished one-sided capture did not do its job, or ``None``."""
    if result.dropped or result.write_errors:
        return f"{result.dropped} records dropped ({result.write_errors} write errors)"
    if result.stopped == "server-closed":
        return "the server closed the connection"
    if until and result.stopped != "caught-up":
        return f"ended before every vbucket caught up ({result.stopped})"
    return None


def run_capture(args: argparse.Namespace) -> int:
    from gateway.tools.capture.tap_capture import capture_tap
    from gateway.tools.capture.upr_capture import capture_upr

    if not (args.tap or args.upr):
        print("capture: give --tap HOST:PORT, --upr HOST:PORT, or both", file=sys.stderr)
        return EXIT_USAGE
    logs.configure_from(args)
    try:
        password_from_file(args)
    except StartupError as unreadable:
        print(f"capture: {unreadable}", file=sys.stderr)
        return EXIT_USAGE
    both = bool(args.tap and args.upr)
    try:
        if both:
            tap, upr = two_sided_options(args)
            targets = [tap, upr]
            where = f"{tap.host}:{tap.port} and {upr.host}:{upr.port}"
        else:
            side, options = options_from(args)
            targets = [options]
            where = f"{options.host}:{options.port}"
    except StartupError as unusable:  # --ca unusable or without --tls
        print(f"capture: {unusable}", file=sys.stderr)
        return EXIT_USAGE
    for options in targets:
        why = _check_out(options.out)
        if why:
            print(f"capture: --out {options.out}: {why}", file=sys.stderr)
            return EXIT_INCOMPLETE
    error: str | None = None
    try:
        if both:
            two = trio.run(
                partial(
                    run_both_until_cut,
                    tap,
                    upr,
                    until_caught_up=args.until_caught_up,
                    cut_timeout=float(args.cut_timeout),
                )
            )
        else:
            runner = capture_tap if side == "tap" else capture_upr
            result = trio.run(run_until_stopped, runner, options)
    except* GatewayError as group:  # CaptureFailed, or a peer that broke the protocol
        error = str(group.exceptions[0])
    except* OSError as group:
        exc = group.exceptions[0]
        error = describe(exc, where.split(":")[0]) if isinstance(exc, OSError) else str(exc)
    if error is not None:
        print(f"capture: {where}: {error}", file=sys.stderr)
        return EXIT_INCOMPLETE
    if both:
        print(two.summary())
        problems = [
            f"{r.side}: {why}"
            for r in (two.tap, two.upr)
            if (why := _incomplete(r, until=False)) and r.stopped != "server-closed"
        ]
        if not two.complete:
            problems.append(f"the cut was not reached: {two.stopped}")
        if problems:
            print(f"capture: {where}: " + "; ".join(problems), file=sys.stderr)
            return EXIT_INCOMPLETE
        return EXIT_OK
    print(result.summary())
    why = _incomplete(result, options.until_caught_up)
    if why:
        print(f"capture: {where}: {why}", file=sys.stderr)
        return EXIT_INCOMPLETE
    return EXIT_OK
