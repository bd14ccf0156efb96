"""Command line: ``tap-upr-gateway <command>`` (also ``python -m gateway``)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import NoReturn

from gateway.cli.args import (
    add_vbucket_count,
    address,
    count,
    float_at_least,
    fraction,
    positive,
    vbucket_list,
)
from gateway.runtime import logs

DIALECTS = ("dcp", "upr-draft")
PRIVATE_UMASK = 0o077


def _add_decode(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "decode",
        help="dissect TAP/UPR packets from a file or stdin into JSON lines",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Read back-to-back memcached binary packets (TAP, UPR or plain memcached)\n"
            "and print one JSON object per packet: protocol, opcode, magic, vbucket or\n"
            "status, opaque, cas, then the message's own fields. Byte strings print as\n"
            "text when valid UTF-8, else as hex:...\n\n"
            "A malformed packet ends the run with exit status 2 and a one-line error\n"
            "naming its byte offset; the packets before it are printed first."
        ),
        epilog="example: tap-upr-gateway decode --hex capture.hex --dialect upr-draft",
    )
    parser.add_argument("file", nargs="?", default="-", help="input file (default: stdin)")
    parser.add_argument("--hex", action="store_true", help="input is hex text; whitespace ignored")
    parser.add_argument(
        "--dialect",
        choices=DIALECTS,
        default="dcp",
        help="UPR dialect: dcp (released 3.0, default) or upr-draft (the transport draft)",
    )
    parser.set_defaults(handler=_run_decode)


def _run_decode(args: argparse.Namespace) -> int:
    from gateway.tools import decode

    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            with open(args.file, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            print(f"decode: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
            return 2
    if args.hex:
        try:
            data = decode.parse_hex(data)
        except decode.DecodeError as exc:
            print(f"decode: {exc}", file=sys.stderr)
            return 2
    return decode.run(data, args.dialect, sys.stdout, sys.stderr)


def _add_node(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "node",
        help="run the embedded reference node (a 2.x TAP / 3.0 UPR server with a real store)",
        description=(
            "Run the reference node: an in-memory vbucket store served over memcached, TAP "
            "(as ep-engine 2.x) and UPR (as 3.0, or the transport draft with --dialect "
            "upr-draft). It is the gateway's default upstream and the peer of the tests."
        ),
        epilog=(
            "examples: tap-upr-gateway node --sample-items 10000;  "
            "tap-upr-gateway node --listen 127.0.0.1:11220 --replica-vbuckets 0-63 "
            "(a move's destination)"
        ),
    )
    parser.add_argument(
        "--listen",
        type=address,
        default=("127.0.0.1", 11210),
        metavar="HOST:PORT",
        help="address to serve (default 127.0.0.1:11210)",
    )
    add_vbucket_count(parser, "how many vbuckets the node has, 0 to N-1 (default 64)")
    parser.add_argument(
        "--replica-vbuckets",
        type=vbucket_list,
        default=[],
        metavar="LIST",
        help="vbuckets that start as replicas, e.g. 0-63 for a move's destination "
        "(default: every vbucket active)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="persist to this directory (msgpack journal; one process per directory; "
        "default: in memory only)",
    )
    parser.add_argument(
        "--fsync",
        choices=("always", "batch", "never"),
        default="batch",
        help="journal fsync policy with --data-dir (default batch)",
    )
    parser.add_argument(
        "--max-items",
        type=positive,
        default=2_000_000,
        metavar="N",
        help="items plus tombstones the store may hold (default 2000000)",
    )
    parser.add_argument(
        "--sample-items",
        type=count,
        default=0,
        metavar="N",
        help="write this many sample items at start (keys sample::NNNNNN; default 0)",
    )
    parser.add_argument(
        "--value-size",
        type=count,
        default=100,
        metavar="BYTES",
        help="sample value size (default 100)",
    )
    parser.add_argument(
        "--dialect", choices=DIALECTS, default="dcp", help="UPR dialect to speak (default dcp)"
    )
    parser.add_argument(
        "--users",
        metavar="FILE",
        help="require SASL PLAIN; FILE has user:password (or user:hash) lines, see README",
    )
    from gateway.cli.security_args import add_listener_options

    add_listener_options(parser, fronts=False)
    logs.add_logging_options(parser)
    parser.set_defaults(handler=_run_node)


def _run_node(args: argparse.Namespace) -> int:
    import trio

    from gateway.cli.startup import StartupError, describe, lock_directory, prepare_directory
    from gateway.node.main import NodeOptions, run_node
    from gateway.runtime import logs

    logs.configure_from(args)
    from gateway.cli.security_args import limits_from, server_tls_from
    from gateway.io.auth import UsersFileError, read_users

    try:
        users = read_users(args.users) if args.users else None
    except UsersFileError as exc:
        print(f"node: {exc}", file=sys.stderr)
        return 2
    try:
        tls = server_tls_from(args)
    except StartupError as exc:
        print(f"node: {exc}", file=sys.stderr)
        return 2
    host, port = args.listen
    held = contextlib.ExitStack()
    if args.data_dir is not None:
        try:
            prepare_directory("--data-dir", args.data_dir)
            held.enter_context(lock_directory("--data-dir", args.data_dir))
        except StartupError as exc:
            print(f"node: {exc}", file=sys.stderr)
            return 1
    outside = [vb for vb in args.replica_vbuckets if vb >= args.vbucket_count]
    if outside:
        print(
            f"node: --replica-vbuckets names vbucket {outside[0]}, but the node has "
            f"{args.vbucket_count} (--vbucket-count)",
            file=sys.stderr,
        )
        return 2
    options = NodeOptions(
        host=host,
        port=port,
        vbuckets=args.vbucket_count,
        data_dir=args.data_dir,
        fsync=args.fsync,
        max_items=args.max_items,
        sample_items=args.sample_items,
        value_size=args.value_size,
        dialect=args.dialect,
        users=users,
        replica_vbuckets=tuple(args.replica_vbuckets),
        limits=limits_from(args, node=True),
        ssl_context=tls,
    )
    try:
        with held:
            trio.run(run_node, options)
    except StartupError as exc:
        print(f"node: {exc}", file=sys.stderr)
        return 1
    except (OSError, BaseExceptionGroup) as exc:
        failure = logs.os_error_in(exc)
        if failure is None:
            raise
        print(f"node: --listen {host}:{port}: {describe(failure, host)}", file=sys.stderr)
        return 1
    return 0


def _add_load(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gateway.cli.security_args import add_client_tls_options, add_password_file_option

    parser = commands.add_parser(
        "load",
        help="drive writes, deletes and short TTLs at a node; prints ops/s",
        description=(
            "Write --items keys (load::N) to a node over memcached, a fraction with a short TTL "
            "so that expirations happen, then delete a fraction of the others; print ops/s."
        ),
        epilog="example: tap-upr-gateway load --target 127.0.0.1:11210 --items 100000 "
        "--ttl-fraction 0.1 --delete-fraction 0.1",
    )
    parser.add_argument(
        "--target",
        type=address,
        default=("127.0.0.1", 11210),
        metavar="HOST:PORT",
        help="node to load (default 127.0.0.1:11210)",
    )
    parser.add_argument("--items", type=count, required=True, metavar="N", help="keys to write")
    parser.add_argument(
        "--value-size", type=count, default=100, metavar="BYTES", help="value size (default 100)"
    )
    parser.add_argument(
        "--ttl-fraction",
        type=fraction,
        default=0.0,
        metavar="F",
        help="fraction of writes with a short TTL (0..1, default 0)",
    )
    parser.add_argument(
        "--ttl", type=positive, default=2, metavar="SECONDS", help="the short TTL (default 2)"
    )
    parser.add_argument(
        "--delete-fraction",
        type=fraction,
        default=0.0,
        metavar="F",
        help="fraction of non-TTL keys deleted after writing (0..1, default 0)",
    )
    parser.add_argument(
        "--rate",
        type=float_at_least(0.001),
        metavar="OPS",
        help="cap on operations per second (default: as fast as the node answers)",
    )
    parser.add_argument("--prefix", default="load", help="key prefix (default load)")
    parser.add_argument("--user", help="SASL PLAIN user")
    parser.add_argument(
        "--password",
        default="",
        help="SASL PLAIN password (visible to other users in ps: prefer "
        "--password-file or $TAP_UPR_GATEWAY_PASSWORD)",
    )
    add_password_file_option(parser)
    add_client_tls_options(parser, "the node")
    parser.set_defaults(handler=_run_load)


def _run_load(args: argparse.Namespace) -> int:
    import trio

    from gateway.cli.security_args import client_tls_from, password_from_file
    from gateway.cli.startup import StartupError, describe, not_memcached
    from gateway.tools.load import run_load

    host, port = args.target
    try:
        password_from_file(args)
        ssl_context = client_tls_from(args)
    except StartupError as exc:
        print(f"load: {exc}", file=sys.stderr)
        return 2
    try:
        report = trio.run(
            partial(
                run_load,
                host,
                port,
                items=args.items,
                value_size=args.value_size,
                ttl_fraction=args.ttl_fraction,
                ttl_seconds=args.ttl,
                delete_fraction=args.delete_fraction,
                rate=args.rate,
                key_prefix=args.prefix,
                user=args.user,
                password=args.password,
                ssl_context=ssl_context,
            )
        )
    except OSError as exc:
        print(f"load: cannot reach {host}:{port}: {describe(exc, host)}", file=sys.stderr)
        return 1
    except Exception as exc:  # a refused login or a target that is not a node
        print(f"load: {host}:{port}: {not_memcached(exc) or exc}", file=sys.stderr)
        return 1
    print(report.summary())
    if set(report.errors) == {"unknown_command"}:
        # the gateway's fronts serve streams and STAT, not writes
        print(
            f"load: {host}:{port} takes no writes (unknown_command): give a node's data port",
            file=sys.stderr,
        )
    return 0 if not report.errors else 1


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


CONFIG_HELP = (
    "TOML file of option values (long names; a [COMMAND] table per command); "
    "TAP_UPR_GATEWAY_<OPTION> environment variables override it, the command line both"
)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the command and where help is, not the usage
    block (20 lines for `serve`) with the reason at its foot."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unrecognized arguments: ...``, with the option meant where one is close."""
    known = [s for action in parser._actions for s in action.option_strings]
    words = []
    for extra in extras:
        close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1, cutoff=0.75)
        words.append(f"{extra} (did you mean {close[0]}?)" if close else extra)
    return "unrecognized arguments: " + " ".join(words)


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="tap-upr-gateway",
        description=(
            "Translate between TAP (Couchbase 2.x replication) and UPR/DCP (3.0): serve old TAP "
            "clients from UPR nodes and UPR consumers from TAP nodes."
        ),
        epilog=(
            "start with `tap-upr-gateway serve` (an embedded upstream with sample data);\n"
            "`tap-upr-gateway COMMAND --help` explains each command"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from gateway.cli.security_args import add_hash_password_parser
    from gateway.cli.serve_args import add_move_parser, add_serve_parser
    from gateway.fronts.upr.checklog import add_check_log_parser
    from gateway.tools.admin import add_admin_parsers
    from gateway.tools.capture.command import add_capture_parser
    from gateway.tools.verify.command import add_verify_parser

    add_serve_parser(commands)
    add_check_log_parser(commands)
    add_move_parser(commands)
    add_capture_parser(commands)
    add_verify_parser(commands)
    _add_decode(commands)
    _add_node(commands)
    _add_load(commands)
    add_admin_parsers(commands)
    add_hash_password_parser(commands)
    parser.add_argument("--config", type=Path, metavar="FILE", help=CONFIG_HELP)
    from gateway.runtime.version import describe

    parser.add_argument("--version", action="version", version=describe())
    for sub in commands.choices.values():
        sub.add_argument("--config", type=Path, metavar="FILE", help=CONFIG_HELP)
    return parser


EXIT_INTERRUPTED = 130
"""128 + SIGINT, as shells report a command stopped by Ctrl-C."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before a command's own handler is set (its imports take a second on a
        # loaded machine): nothing was started, so stop quietly, without a traceback.
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    from gateway.cli import settings

    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    commands = _commands(parser)
    try:
        settings.load(words, commands)
    except settings.SettingsError as exc:
        command = settings.find_command(words, commands)
        (commands[command] if command else parser).error(str(exc))
    args, extras = parser.parse_known_args(words)
    if extras:
        command = getattr(args, "command", None)
        owner = commands.get(command or "", parser)
        owner.error(unrecognized(owner, extras))
    # Everything the commands create (state, logs, captures, node data) is private:
    # directories 0700, files 0600.
    old_umask = os.umask(PRIVATE_UMASK)
    try:
        return int(args.handler(args))
    finally:
        os.umask(old_umask)
