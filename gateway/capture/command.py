"""``tap-upr-gateway capture``: record a TAP or UPR endpoint's streams to segment files."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from adapters.errors import GatewayError
from gateway.capture.session import (
    DEFAULT_BUFFER_SIZE,
    CaptureOptions,
    CaptureResult,
)

DIALECTS = ("dcp", "upr-draft")


def _address(text: str) -> tuple[str, int]:
    from gateway.wire import parse_hostport

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


def add_capture_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "capture",
        help="record every vbucket of a TAP or UPR endpoint to capture segments",
        description=(
            "Connect to a TAP or UPR endpoint (a node or the gateway) and record, without "
            "translating, a full backfill of every active vbucket and then live changes, as "
            "msgpack records in size-rotated segment files under --out. Stops on SIGTERM or "
            "Ctrl-C (closing the segments cleanly), or with --until-caught-up once every "
            "vbucket reached the high seqno it had at start. `verify` compares two captures."
        ),
        epilog="example: tap-upr-gateway capture --upr 127.0.0.1:11210 --out cap/upr "
        "--until-caught-up",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--tap", type=_address, metavar="HOST:PORT", help="a TAP endpoint")
    target.add_argument("--upr", type=_address, metavar="HOST:PORT", help="a UPR endpoint")
    parser.add_argument("--out", type=Path, required=True, help="directory for the segments")
    parser.add_argument(
        "--dialect", choices=DIALECTS, default="dcp", help="UPR dialect (default dcp)"
    )
    parser.add_argument(
        "--until-caught-up",
        action="store_true",
        help="stop once every vbucket reached the high seqno seen at start",
    )
    parser.add_argument("--user", help="SASL PLAIN user")
    parser.add_argument("--password", default="", help="SASL PLAIN password")
    parser.add_argument("--name", help="connection name (default capture-SIDE-HOST-PORT)")
    parser.add_argument(
        "--vbuckets", type=_vbuckets, help="only these vbuckets, e.g. 0-3,9 (default all active)"
    )
    parser.add_argument(
        "--buffer-size",
        type=_positive,
        default=DEFAULT_BUFFER_SIZE,
        help=f"UPR connection_buffer_size in bytes (default {DEFAULT_BUFFER_SIZE})",
    )
    parser.add_argument(
        "--segment-mb", type=_positive, default=64, help="rotate segments at this size (MiB)"
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less logging")
    parser.set_defaults(handler=run_capture)
    return parser


def options_from(args: argparse.Namespace) -> tuple[str, CaptureOptions]:
    side = "tap" if args.tap else "upr"
    host, port = args.tap or args.upr
    return side, CaptureOptions(
        host=host,
        port=port,
        out=args.out,
        until_caught_up=args.until_caught_up,
        user=args.user,
        password=args.password,
        name=args.name,
        vbuckets=args.vbuckets,
        dialect=args.dialect,
        buffer_size=args.buffer_size,
        max_segment_bytes=args.segment_mb * 1024 * 1024,
    )


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


def run_capture(args: argparse.Namespace) -> int:
    from gateway import logs
    from gateway.capture.tap_capture import capture_tap
    from gateway.capture.upr_capture import capture_upr

    logs.configure(args.verbose - args.quiet)
    side, options = options_from(args)
    runner = capture_tap if side == "tap" else capture_upr
    where = f"{options.host}:{options.port}"
    error: str | None = None
    try:
        result = trio.run(run_until_stopped, runner, options)
    except* GatewayError as group:  # CaptureFailed, or a peer that broke the protocol
        error = str(group.exceptions[0])
    except* OSError as group:
        exc = group.exceptions[0]
        error = str(getattr(exc, "strerror", None) or exc)
    if error is not None:
        print(f"capture: {where}: {error}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0
