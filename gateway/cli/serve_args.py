"""Command line of ``serve`` (both fronts) and ``move`` (vbucket moves through the gateway)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from functools import partial
from pathlib import Path

from gateway.cli.args import (
    add_vbucket_count,
    address,
    count,
    float_at_least,
    int_between,
    vbucket_list,
)
from gateway.cli.security_args import (
    add_listener_options,
    add_move_tls_options,
    add_upstream_options,
    limits_from,
    move_tls_from,
    server_tls_from,
    upstream_password_from,
    upstream_tls_from,
)
from gateway.cli.serve import (
    DEFAULT_METRICS_LISTEN,
    DEFAULT_TAP_LISTEN,
    DEFAULT_UPR_LISTEN,
    ServeOptions,
)
from gateway.cli.startup import (
    StartupError,
    describe,
    describe_file,
    lock_directory,
    prepare_directory,
    startup_error_in,
)
from gateway.runtime import logs

DIALECTS = ("dcp", "upr-draft")
DEFAULT_UPSTREAM_NOOP_INTERVAL = 120
"""The TAP front's (``gateway.fronts.tap.upstream.DEFAULT_NOOP_INTERVAL``, not
imported here: the parser is built for every command)."""
MAX_NOOP_INTERVAL = 2**32 - 1
"""The producer reads the value as a 32-bit number (``parseUint32``)."""

log = logging.getLogger("gateway.cli.serve")
EMBEDDED_DEFAULTS: dict[str, float] = {
    "vbucket_count": 64,
    "sample_items": 10_000,
    "writes_per_second": 20.0,
}
"""The embedded node's options (by dest) and defaults: with an upstream they do nothing."""


def _show(address: tuple[str, int]) -> str:
    return "{}:{}".format(*address)


def add_serve_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the gateway: TAP clients from a UPR node, UPR consumers from a TAP node",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run the gateway. The TAP front (--tap-listen) serves old TAP clients from the\n"
            "UPR streams of --upr-upstream; the UPR front (--upr-listen) serves UPR consumers\n"
            "from the TAP stream of --tap-upstream, through a durable log in --state-dir.\n"
            "Each front runs when its upstream is given. With no upstream at all, an embedded\n"
            "reference node with sample data and live writes is started and both fronts\n"
            "read from it. Prometheus metrics are served on --metrics-listen."
        ),
        epilog=(
            "examples:\n"
            "  tap-upr-gateway serve                                  # embedded upstream\n"
            "  tap-upr-gateway serve --upr-upstream node3:11210       # TAP front only\n"
            "  tap-upr-gateway serve --tap-upstream node1:11210 --state-dir /var/lib/gw"
        ),
    )
    parser.add_argument(
        "--tap-listen",
        type=address,
        default=DEFAULT_TAP_LISTEN,
        metavar="HOST:PORT",
        help=f"where TAP clients connect (default {_show(DEFAULT_TAP_LISTEN)})",
    )
    parser.add_argument(
        "--upr-upstream", type=address, metavar="HOST:PORT", help="the UPR (3.0) node to read"
    )
    parser.add_argument(
        "--upr-listen",
        type=address,
        default=DEFAULT_UPR_LISTEN,
        metavar="HOST:PORT",
        help=f"where UPR consumers connect (default {_show(DEFAULT_UPR_LISTEN)})",
    )
    parser.add_argument(
        "--tap-upstream", type=address, metavar="HOST:PORT", help="the TAP (2.x) node to read"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="durable state: the UPR front's log, TAP registered clients; one process per "
        "directory (default: a temporary directory, removed on exit)",
    )
    parser.add_argument(
        "--fsync",
        choices=("always", "batch", "never"),
        default="batch",
        help="when the UPR front's log is fsynced before TAP acks (default batch)",
    )
    parser.add_argument(
        "--dialect", choices=DIALECTS, default="dcp", help="UPR dialect (default dcp, i.e. 3.0)"
    )
    add_upstream_options(parser)
    parser.add_argument(
        "--upstream-noop-interval",
        type=int_between(1, MAX_NOOP_INTERVAL),
        metavar="SECONDS",
        help=(
            "seconds between the NOOPs the UPR upstream sends each TAP front connection "
            f"(CONTROL set_noop_interval; default {DEFAULT_UPSTREAM_NOOP_INTERVAL})"
        ),
    )
    parser.add_argument(
        "--users",
        metavar="FILE",
        help="require SASL PLAIN from clients; user:password (or user:hash) lines, see README",
    )
    parser.add_argument(
        "--metrics-listen",
        type=address,
        default=DEFAULT_METRICS_LISTEN,
        metavar="HOST:PORT",
        help=(
            "Prometheus /metrics, /healthz, /readyz and the status page at / "
            f"(default {_show(DEFAULT_METRICS_LISTEN)})"
        ),
    )
    parser.add_argument(
        "--no-metrics",
        action="store_true",
        help="serve no /metrics, /healthz, /readyz nor status page",
    )
    parser.add_argument(
        "--capture-dir",
        type=Path,
        metavar="DIR",
        help="record every item each front connection receives and sends, for `verify` "
        "(default: no recording)",
    )
    parser.add_argument(
        "--per-vbucket-metrics",
        action="store_true",
        help="add a vbucket label to per-stream series (many series with 1024 vbuckets)",
    )
    embedded = parser.add_argument_group("embedded upstream (when no upstream is given)")
    add_vbucket_count(embedded, "how many vbuckets the embedded node has (default 64)")
    embedded.add_argument(
        "--sample-items",
        type=count,
        default=EMBEDDED_DEFAULTS["sample_items"],
        metavar="N",
        help="items written to the embedded node at start (default 10000)",
    )
    embedded.add_argument(
        "--writes-per-second",
        type=float_at_least(0.0),
        default=EMBEDDED_DEFAULTS["writes_per_second"],
        metavar="N",
        help="live writes per second to the embedded node (default 20; 0 for none)",
    )
    add_listener_options(parser, fronts=True)
    logs.add_logging_options(parser)
    parser.set_defaults(handler=run_serve_command)


def run_serve_command(args: argparse.Namespace) -> int:
    import trio

    from gateway.cli.serve import run_serve
    from gateway.runtime import logs

    logs.configure_from(args)
    _warn_embedded_only(args)
    from gateway.io.auth import UsersFileError, read_users

    try:
        users = read_users(args.users) if args.users else None
    except UsersFileError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    try:
        tls, upstream_tls = server_tls_from(args), upstream_tls_from(args)
        upstream_password = upstream_password_from(args)
        if upstream_tls is not None and not (args.upr_upstream or args.tap_upstream):
            raise StartupError(
                "--upstream-tls needs --upr-upstream or --tap-upstream "
                "(the embedded node speaks plain TCP)"
            )
    except StartupError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    options = ServeOptions(
        freeze_gc=True,
        tap_listen=args.tap_listen,
        upr_upstream=args.upr_upstream,
        upr_listen=args.upr_listen,
        tap_upstream=args.tap_upstream,
        metrics_listen=None if args.no_metrics else args.metrics_listen,
        per_vbucket_metrics=args.per_vbucket_metrics,
        state_dir=args.state_dir,
        dialect=args.dialect,
        upstream_user=args.upstream_user,
        upstream_password=upstream_password,
        users=users,
        limits=limits_from(args),
        tls=tls,
        upstream_tls=upstream_tls,
        upstream_noop_interval=args.upstream_noop_interval,
        fsync=args.fsync,
        capture_dir=args.capture_dir,
        embedded_vbuckets=args.vbucket_count,
        embedded_sample_items=args.sample_items,
        embedded_writes_per_second=args.writes_per_second,
    )
    try:
        trio.run(run_serve, options)
    except (OSError, BaseExceptionGroup, StartupError) as exc:
        failure = startup_error_in(exc)
        if failure is not None:
            print(f"serve: {failure}", file=sys.stderr)
            return 1
        os_failure = logs.os_error_in(exc)
        if os_failure is None:
            raise
        if os_failure.filename is not None:  # a file of the state or capture directory
            print(f"serve: {os_failure.filename}: {describe_file(os_failure)}", file=sys.stderr)
        else:
            print(f"serve: {describe(os_failure)}", file=sys.stderr)
        return 1
    return 0


def _warn_embedded_only(args: argparse.Namespace) -> None:
    """An embedded-node option beside an upstream changes nothing: say so, since the
    operator meant something by it (a vbucket count for the upstream, say)."""
    if args.upr_upstream is None and args.tap_upstream is None:
        return
    given = [
        f"--{dest.replace('_', '-')} {value:g}" if isinstance(value, float) else
        f"--{dest.replace('_', '-')} {value}"
        for dest, default in EMBEDDED_DEFAULTS.items()
        if (value := getattr(args, dest)) != default
    ]  # fmt: skip
    if given:
        log.warning(
            "%s: only for the embedded node, which does not run when --upr-upstream or "
            "--tap-upstream is given; ignored",
            ", ".join(given),
        )


def add_move_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "move",
        help="move vbuckets between a UPR node and a TAP node through the gateway",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Move vbuckets during a rolling upgrade.\n"
            "  --from-upr A --to-tap B: stream from a 3.0 node into a 2.x node's TAP receiver,\n"
            "    ending with an acknowledged CLOSE_TAP_STREAM (as the 2.x mover did);\n"
            "  --from-tap A --to-upr B: stream from a 2.x node into a 3.0 node, which opens a\n"
            "    consumer connection and requests the streams itself (ADD_STREAM).\n"
            "With --takeover the source ends dead and the destination active.\n"
            "TLS: --tls [--ca FILE] for both nodes, or\n"
            "--source-tls/--destination-tls [--source-ca/--destination-ca FILE] for one."
        ),
        epilog=(
            "example (two fresh reference nodes):\n"
            "  tap-upr-gateway node --listen 127.0.0.1:11210 --sample-items 1000 &\n"
            "  tap-upr-gateway node --listen 127.0.0.1:11220 --replica-vbuckets 0-63 &\n"
            "  tap-upr-gateway move --from-tap 127.0.0.1:11210 --to-upr 127.0.0.1:11220 \\\n"
            "      --vbuckets 1,2 --takeover\n"
            "  tap-upr-gateway stats 127.0.0.1:11220 vbucket"
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-upr", type=address, metavar="HOST:PORT", help="UPR source node")
    source.add_argument("--from-tap", type=address, metavar="HOST:PORT", help="TAP source node")
    parser.add_argument("--to-tap", type=address, metavar="HOST:PORT", help="TAP destination")
    parser.add_argument("--to-upr", type=address, metavar="HOST:PORT", help="UPR destination")
    parser.add_argument(
        "--vbuckets",
        type=vbucket_list,
        required=True,
        metavar="LIST",
        help="vbucket ids, e.g. 1,2 or 0-15",
    )
    parser.add_argument("--takeover", action="store_true", help="hand the vbuckets over")
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="log directory (--from-tap only; default: a temporary directory)",
    )
    parser.add_argument(
        "--dialect", choices=DIALECTS, default="dcp", help="UPR dialect (default dcp)"
    )
    parser.add_argument("--upstream-user", metavar="USER", help="SASL PLAIN user for the source")
    parser.add_argument(
        "--upstream-password-file",
        type=Path,
        metavar="FILE",
        help="file holding the source's password (or set $TAP_UPR_GATEWAY_UPSTREAM_PASSWORD)",
    )
    parser.add_argument(
        "--upstream-password",
        default="",
        metavar="PASSWORD",
        help="the source's password (visible in ps: prefer the file or the variable)",
    )
    add_move_tls_options(parser)
    logs.add_logging_options(parser)
    parser.set_defaults(handler=run_move_command)


def run_move_command(args: argparse.Namespace) -> int:
    import trio

    from adapters import upr
    from adapters.errors import GatewayError
    from gateway.runtime import logs

    logs.configure_from(args)
    if args.from_upr and not args.to_tap:
        print("move: --from-upr needs --to-tap", file=sys.stderr)
        return 2
    if args.from_tap and not args.to_upr:
        print("move: --from-tap needs --to-upr", file=sys.stderr)
        return 2
    user = args.upstream_user
    try:
        password = upstream_password_from(args)
        source_ssl, destination_ssl = move_tls_from(args)
    except StartupError as exc:
        print(f"move: {exc}", file=sys.stderr)
        return 2
    try:
        if args.from_upr:
            from gateway.fronts.tap.move import move_upr_to_tap
            from gateway.fronts.tap.session import SessionConfig

            config = SessionConfig(
                upstream=args.from_upr,
                dialect=upr.get_dialect(args.dialect),
                user=user,
                password=password,
                reconnect_attempts=5,
                ssl_context=source_ssl,
            )
            trio.run(
                partial(
                    move_upr_to_tap,
                    args.from_upr,
                    args.to_tap,
                    args.vbuckets,
                    takeover=args.takeover,
                    config=config,
                    destination_ssl=destination_ssl,
                )
            )
        else:
            import tempfile

            from gateway.fronts.upr import move_tap_to_upr

            with contextlib.ExitStack() as cleanup:
                if args.state_dir is not None:
                    state_dir = prepare_directory("--state-dir", args.state_dir)
                    cleanup.enter_context(lock_directory("--state-dir", state_dir))
                else:
                    temporary = tempfile.TemporaryDirectory(prefix="tap-upr-move-")
                    state_dir = Path(cleanup.enter_context(temporary))
                trio.run(
                    partial(
                        move_tap_to_upr,
                        args.from_tap,
                        args.to_upr,
                        args.vbuckets,
                        takeover=args.takeover,
                        state_dir=state_dir,
                        upstream_user=user,
                        upstream_password=password,
                        source_ssl=source_ssl,
                        destination_ssl=destination_ssl,
                    )
                )
    except (GatewayError, OSError, StartupError) as exc:
        print(f"move: {exc}", file=sys.stderr)
        return 1
    direction = "UPR -> TAP" if args.from_upr else "TAP -> UPR"
    print(
        f"moved vbuckets {','.join(map(str, args.vbuckets))} ({direction})"
        + (" with takeover" if args.takeover else "")
    )
    return 0
