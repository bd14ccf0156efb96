"""``python -m gateway.tools.capture capture --tap|--upr HOST:PORT --out DIR``."""

import argparse

from gateway.tools.capture.command import add_capture_parser

parser = argparse.ArgumentParser(prog="python -m gateway.tools.capture")
add_capture_parser(parser.add_subparsers(dest="command", required=True))
arguments = parser.parse_args()
raise SystemExit(arguments.handler(arguments))
