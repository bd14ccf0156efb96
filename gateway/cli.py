"""Command line: ``tap-upr-gateway <command>`` (also ``python -m gateway``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

DIALECTS = ("dcp", "upr-draft")


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
    from gateway import decode

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tap-upr-gateway",
        description=(
            "Translate between TAP (Couchbase 2.x replication) and UPR/DCP (3.0): serve old TAP "
            "clients from UPR nodes and UPR consumers from TAP nodes."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_decode(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
