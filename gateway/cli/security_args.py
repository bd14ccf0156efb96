"""Security options shared by ``serve`` and ``node``, and the ``hash-password`` command.

Listener guards (``--max-connections``, ``--handshake-timeout``,
``--frame-timeout``), TLS (``--tls-cert``/``--tls-key`` for listeners,
``--upstream-tls``/``--upstream-ca`` for the gateway's upstream
connections, ``--tls``/``--ca`` for the client commands and, per node,
``--source-tls``/``--destination-tls`` for ``move``) and the upstream
password, which never needs the command line: ``--upstream-password-file
FILE`` or the ``TAP_UPR_GATEWAY_UPSTREAM_PASSWORD`` environment variable
(``gateway.cli.settings`` maps every option to one).
"""

from __future__ import annotations

import argparse
import getpass
import logging
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.cli.args import float_at_least, positive
from gateway.cli.startup import StartupError
from gateway.io.limits import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
)

log = logging.getLogger("gateway.cli.serve")

PASSWORD_ENV = "TAP_UPR_GATEWAY_UPSTREAM_PASSWORD"


def add_listener_options(parser: argparse.ArgumentParser, *, fronts: bool) -> None:
    group = parser.add_argument_group("listener limits and TLS")
    group.add_argument(
        "--max-connections",
        type=positive,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="connections per listener; more are refused, logged and counted "
        f"(default {DEFAULT_MAX_CONNECTIONS})",
    )
    what = "authenticate (and, idle, to send TAP CONNECT / UPR OPEN)" if fronts else "authenticate"
    group.add_argument(
        "--handshake-timeout",
        type=float_at_least(0.001),
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        metavar="SECONDS",
        help=f"seconds a new connection has to {what} (default {DEFAULT_HANDSHAKE_TIMEOUT:g})",
    )
    group.add_argument(
        "--frame-timeout",
        type=float_at_least(0.001),
        default=DEFAULT_FRAME_TIMEOUT,
        metavar="SECONDS",
        help="seconds a started packet header may take to arrive whole "
        f"(default {DEFAULT_FRAME_TIMEOUT:g})",
    )
    group.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="serve TLS with this PEM certificate (chain)"
    )
    group.add_argument(
        "--tls-key", type=Path, metavar="FILE", help="its PEM private key (default: in --tls-cert)"
    )


def add_upstream_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--upstream-user", metavar="USER", help="SASL PLAIN user for the upstream nodes"
    )
    parser.add_argument(
        "--upstream-password-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the upstream password (or set ${PASSWORD_ENV})",
    )
    parser.add_argument(
        "--upstream-password",
        default="",
        metavar="PASSWORD",
        help=f"upstream password (visible to other users in ps: prefer ${PASSWORD_ENV} "
        "or --upstream-password-file)",
    )
    parser.add_argument(
        "--upstream-tls", action="store_true", help="connect to the upstream nodes over TLS"
    )
    parser.add_argument(
        "--upstream-ca",
        type=Path,
        metavar="FILE",
        help="CA certificates (PEM) to check the upstream's certificate (default: the system's)",
    )


def add_client_tls_options(parser: argparse.ArgumentParser, server: str = "the server") -> None:
    """``--tls``/``--ca`` for the commands that dial one server (stats, vbucket, capture, load)."""
    parser.add_argument(
        "--tls",
        action="store_true",
        help=f"connect to {server} over TLS (as Couchbase's TLS port 11207; its certificate "
        "is checked against --ca, else the system's CAs, and its address)",
    )
    parser.add_argument(
        "--ca",
        type=Path,
        metavar="FILE",
        help="CA certificates (PEM) to check the server's certificate (needs --tls)",
    )


def client_tls_from(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The context ``add_client_tls_options`` asked for, or None for plain TCP."""
    from gateway.io.tls import client_context

    if not args.tls:
        if args.ca is not None:
            raise StartupError(f"--ca {args.ca}: needs --tls")
        return None
    return client_context(args.ca, option="--ca")


def add_move_tls_options(parser: argparse.ArgumentParser) -> None:
    """TLS for ``move``, which dials two nodes that may differ (a 2.x node served no TLS):
    ``--tls``/``--ca`` for both, ``--source-*``/``--destination-*`` for one."""
    group = parser.add_argument_group(
        "TLS (as Couchbase's TLS port 11207; each certificate checked against the CA "
        "option, else the system's CAs, and against the node's address)"
    )
    group.add_argument("--tls", action="store_true", help="reach both nodes over TLS")
    group.add_argument(
        "--ca",
        type=Path,
        metavar="FILE",
        help="CA certificates (PEM) for both nodes (needs a TLS option)",
    )
    for end, flags in (("source", "--from-*"), ("destination", "--to-*")):
        group.add_argument(
            f"--{end}-tls", action="store_true", help=f"reach the {end} ({flags}) over TLS"
        )
        group.add_argument(
            f"--{end}-ca",
            type=Path,
            metavar="FILE",
            help=f"CA certificates (PEM) for the {end}, instead of --ca "
            f"(needs --{end}-tls or --tls)",
        )


def move_tls_from(
    args: argparse.Namespace,
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """The source's and the destination's contexts ``add_move_tls_options`` asked for
    (None: plain TCP)."""
    from gateway.io.tls import client_context

    contexts: list[ssl.SSLContext | None] = []
    for end in ("source", "destination"):
        own_ca = getattr(args, f"{end}_ca")
        if not (args.tls or getattr(args, f"{end}_tls")):
            if own_ca is not None:
                raise StartupError(f"--{end}-ca {own_ca}: needs --{end}-tls or --tls")
            contexts.append(None)
        elif own_ca is not None:
            contexts.append(client_context(own_ca, option=f"--{end}-ca"))
        else:
            contexts.append(client_context(args.ca, option="--ca"))
    if args.ca is not None and contexts == [None, None]:
        raise StartupError(f"--ca {args.ca}: needs --tls, --source-tls or --destination-tls")
    return contexts[0], contexts[1]


def limits_from(args: argparse.Namespace, *, node: bool = False) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections=args.max_connections,
        handshake_timeout=args.handshake_timeout,
        command_idle_timeout=None if node else args.handshake_timeout,
        frame_timeout=args.frame_timeout,
    )


def server_tls_from(args: argparse.Namespace) -> ssl.SSLContext | None:
    from gateway.io.tls import server_context

    if args.tls_cert is None:
        if args.tls_key is not None:
            raise StartupError(f"--tls-key {args.tls_key}: needs --tls-cert")
        return None
    return server_context(args.tls_cert, args.tls_key)


def upstream_tls_from(args: argparse.Namespace) -> ssl.SSLContext | None:
    from gateway.io.tls import client_context

    if not args.upstream_tls:
        if args.upstream_ca is not None:
            raise StartupError(f"--upstream-ca {args.upstream_ca}: needs --upstream-tls")
        return None
    return client_context(args.upstream_ca)


def read_password_file(option: str, path: Path) -> str:
    """The password in ``path`` (its first line's end stripped), or a one-line
    ``StartupError`` naming ``option`` and why it cannot be read.

    An empty file is refused (it would log in with an empty password and fail as a
    wrong one); one that other users may read is used, with a warning."""
    try:
        text = str(path.read_text(encoding="utf-8")).rstrip("\r\n")
        mode = path.stat().st_mode & 0o777
    except OSError as exc:
        raise StartupError(f"{option} {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise StartupError(f"{option} {path}: not UTF-8 text") from None
    if not text:
        raise StartupError(f"{option} {path}: empty: put the password on its first line")
    if mode & 0o077:
        log.warning("%s %s is readable by other users (mode %o): chmod 600 it", option, path, mode)
    return text


CLIENT_PASSWORD_ENV = "TAP_UPR_GATEWAY_PASSWORD"


def add_password_file_option(parser: argparse.ArgumentParser) -> None:
    """``--password-file`` for the client commands that log in with ``--user``."""
    parser.add_argument(
        "--password-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the --user's password (or set ${CLIENT_PASSWORD_ENV})",
    )


def password_from_file(args: argparse.Namespace) -> None:
    """Set ``args.password`` from ``--password-file`` when it was given."""
    if args.password_file is None:
        return
    if args.user is None:
        raise StartupError(f"--password-file {args.password_file}: needs --user")
    args.password = read_password_file("--password-file", args.password_file)


def upstream_password_from(
    args: argparse.Namespace, argv: Sequence[str] | None = None
) -> str | None:
    """The upstream password from its file, the environment or the command line."""
    argv = sys.argv[1:] if argv is None else argv
    if args.upstream_user is None:
        if args.upstream_password_file is not None:
            raise StartupError(
                f"--upstream-password-file {args.upstream_password_file}: needs --upstream-user"
            )
        return None
    if args.upstream_password_file is not None:
        return read_password_file("--upstream-password-file", args.upstream_password_file)
    if any(w == "--upstream-password" or w.startswith("--upstream-password=") for w in argv):
        log.warning(
            "--upstream-password on the command line is visible to other users (ps); "
            "use $%s or --upstream-password-file",
            PASSWORD_ENV,
        )
    return str(args.upstream_password)


# -- hash-password -------------------------------------------------------------


def add_hash_password_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gateway.io.auth import DEFAULT_ITERATIONS

    parser = commands.add_parser(
        "hash-password",
        help="make a salted PBKDF2 hash of a password for the --users file",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Read a password (asked on the terminal, twice, or one line from stdin) and\n"
            "print a users-file secret: pbkdf2_sha256$<iterations>$<salt>$<hash>.\n"
            "Put it after 'user:' in the --users file; the password never appears on\n"
            "the command line or in the file."
        ),
        epilog=(
            "example:\n"
            '  echo "replica:$(tap-upr-gateway hash-password)" >> /etc/tap-upr-gateway/users\n'
            "  printf '%s\\n' \"$PW\" | tap-upr-gateway hash-password --user replica"
        ),
    )
    parser.add_argument("--user", help="print a whole users-file line, user:hash")
    parser.add_argument("--admin", action="store_true", help="mark the --user line admin")
    parser.add_argument(
        "--iterations",
        type=positive,
        default=DEFAULT_ITERATIONS,
        metavar="N",
        help=f"PBKDF2 iterations (default {DEFAULT_ITERATIONS})",
    )
    parser.set_defaults(handler=run_hash_password)


def _read_password() -> str:
    if sys.stdin.isatty():
        first = getpass.getpass("password: ")
        if getpass.getpass("again: ") != first:
            raise ValueError("the two passwords differ")
        return first
    line = sys.stdin.readline()
    if not line:
        raise ValueError("no password on stdin")
    return line.rstrip("\r\n")


def run_hash_password(args: argparse.Namespace) -> int:
    from gateway.io.auth import hash_password

    if args.admin and not args.user:
        print("hash-password: --admin needs --user", file=sys.stderr)
        return 2
    try:
        password = _read_password()
    except (ValueError, EOFError, KeyboardInterrupt) as exc:
        print(f"hash-password: {exc or 'cancelled'}", file=sys.stderr)
        return 1
    if not password:
        print("hash-password: the password is empty", file=sys.stderr)
        return 1
    secret = hash_password(password, iterations=args.iterations)
    if args.user:
        print(("admin " if args.admin else "") + f"{args.user}:{secret}")
    else:
        print(secret)
    return 0
