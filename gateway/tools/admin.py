"""``stats`` and ``vbucket``: cbstats- and cbepctl-like commands for a node or the gateway.

``tap-upr-gateway stats HOST:PORT [GROUP]`` prints a STAT group (one
``key: value`` line each, or one JSON object with ``--json``);
``tap-upr-gateway vbucket HOST:PORT VB STATE`` sets a vbucket's state with
SET_VBUCKET (0x3d), as ``cbepctl set_vbucket_state`` did. Both speak plain
memcached binary, SASL PLAIN first when ``--user`` is given (the password
from ``--password-file`` or the TAP_UPR_GATEWAY_PASSWORD environment
variable, never needed on the command line), inside TLS with ``--tls``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

from gateway.cli.args import address

PASSWORD_ENV = "TAP_UPR_GATEWAY_PASSWORD"
STATES = {"active": 1, "replica": 2, "pending": 3, "dead": 4}
"""The engine's numbering, which SET_VBUCKET carries (memcached protocol_binary.h)."""


def _add_login(parser: argparse.ArgumentParser) -> None:
    from gateway.cli.security_args import add_client_tls_options

    parser.add_argument("--user", help="SASL PLAIN user")
    parser.add_argument(
        "--password-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the password (default: ${PASSWORD_ENV}, else empty)",
    )
    add_client_tls_options(parser)


def add_admin_parsers(commands: argparse._SubParsersAction[Any]) -> None:
    stats = commands.add_parser(
        "stats",
        help="print a STAT group of a node or the gateway (like cbstats)",
        description="Print one STAT group, a 'key: value' line per stat.",
        epilog="examples: tap-upr-gateway stats 127.0.0.1:11210 vbucket-seqno;  "
        "tap-upr-gateway stats 127.0.0.1:11213 dcp --json",
    )
    stats.add_argument("target", type=address, metavar="HOST:PORT", help="node or front")
    stats.add_argument(
        "group",
        nargs="*",
        default=[],
        help="group and its arguments, e.g. vbucket-seqno 5 (default: the general stats)",
    )
    stats.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    _add_login(stats)
    stats.set_defaults(handler=_run_stats)

    vbucket = commands.add_parser(
        "vbucket",
        help="set a vbucket's state on a node (like cbepctl set_vbucket_state)",
        description="Set the state of a vbucket with SET_VBUCKET.",
        epilog="example: tap-upr-gateway vbucket 127.0.0.1:11220 5 replica",
    )
    vbucket.add_argument("target", type=address, metavar="HOST:PORT", help="the node")
    vbucket.add_argument("vbucket", type=_vbucket_id, help="vbucket id")
    vbucket.add_argument("state", choices=tuple(STATES), help="the new state")
    _add_login(vbucket)
    vbucket.set_defaults(handler=_run_vbucket)


def _vbucket_id(text: str) -> int:
    from gateway.cli.args import int_between

    return int_between(0, 65535)(text)


def _password(args: argparse.Namespace) -> str:
    from gateway.cli.security_args import read_password_file

    if args.password_file is not None:
        return read_password_file("--password-file", args.password_file)
    return os.environ.get(PASSWORD_ENV, "")


def _settle_options(args: argparse.Namespace) -> None:
    """Read the password and build the TLS context before dialling, so a bad file is
    named as such rather than as a failure of the server."""
    from gateway.cli.security_args import client_tls_from

    args.ssl_context = client_tls_from(args)
    args.secret = _password(args) if args.user else ""


async def _login(args: argparse.Namespace) -> Any:
    from gateway.io.connection import PacketConnection

    host, port = args.target
    client = await PacketConnection.connect(
        host, port, name=f"{host}:{port}", ssl_context=args.ssl_context
    )
    if args.user:
        try:
            await client.sasl_plain(args.user, args.secret)
        except BaseException:
            await client.aclose()
            raise
    return client


async def _stats(args: argparse.Namespace) -> dict[str, str]:
    async with await _login(args) as client:
        result: dict[str, str] = await client.stats(" ".join(args.group))
        return result


async def _set_state(args: argparse.Namespace) -> None:
    from adapters.mcbp import Opcode

    async with await _login(args) as client:
        await client.request(
            Opcode.SET_VBUCKET, vbucket=args.vbucket, extras=struct.pack(">I", STATES[args.state])
        )


def _fail(command: str, args: argparse.Namespace, exc: BaseException) -> int:
    from gateway.cli.startup import describe, not_memcached
    from gateway.io.connection import RequestFailed

    host, port = args.target
    if isinstance(exc, OSError):
        reason = describe(exc, host)
    elif isinstance(exc, RequestFailed):
        reason = str(exc)
    else:
        reason = not_memcached(exc) or str(exc) or type(exc).__name__
    print(f"{command}: {host}:{port}: {reason}", file=sys.stderr)
    return 1


def _run_stats(args: argparse.Namespace) -> int:
    import trio

    from adapters.errors import GatewayError
    from gateway.cli.startup import StartupError

    try:
        _settle_options(args)
    except StartupError as exc:
        print(f"stats: {exc}", file=sys.stderr)
        return 2
    try:
        values = trio.run(_stats, args)
    except (OSError, GatewayError) as exc:
        return _fail("stats", args, exc)
    if args.json:
        print(json.dumps(values, indent=2, sort_keys=True))
    else:
        width = max((len(k) for k in values), default=0)
        for key, value in values.items():
            print(f"{key + ':':<{width + 1}} {value}")
    return 0


def _run_vbucket(args: argparse.Namespace) -> int:
    import trio

    from adapters.errors import GatewayError
    from gateway.cli.startup import StartupError

    try:
        _settle_options(args)
    except StartupError as exc:
        print(f"vbucket: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(_set_state, args)
    except (OSError, GatewayError) as exc:
        return _fail("vbucket", args, exc)
    print(f"vbucket {args.vbucket} is now {args.state} on {args.target[0]}:{args.target[1]}")
    return 0
