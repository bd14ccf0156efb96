"""Argument types shared by the subcommands: each rejects a bad value at parse time.

argparse turns the ``ArgumentTypeError`` into one line naming the option
(``argument --vbuckets: 0 is not between 1 and 65536``) and exit status 2,
so no bad value reaches the code that would fail later with a traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

MAX_VBUCKETS = 65536
"""vbucket ids are 16-bit on the wire."""


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` with a host and a port from 0 to 65535."""
    from gateway.io.listen import parse_hostport

    host, sep, _ = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no port: write HOST:PORT, e.g. {text or '127.0.0.1'}:11210"
        )
    if host.startswith("[") != host.endswith("]"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: unbalanced brackets: write an IPv6 address as [::1]:PORT"
        )
    if not host.strip("[]").strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} has no host: write HOST:PORT, e.g. 127.0.0.1{text}"
        )
    try:
        return parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_between(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]`` (no upper bound when ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is not {bound}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= low:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text} is not at least {low:g}")
        return value

    parse.__name__ = "number"
    return parse


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = float_at_least(0.0)(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


vbucket_count = int_between(1, MAX_VBUCKETS)
count = int_between(0)
positive = int_between(1)


def vbucket_list(text: str) -> list[int]:
    """``1,2,5-9``: vbucket ids from 0 to 65535, ranges inclusive."""
    out: list[int] = []
    try:
        for part in text.split(","):
            if not part.strip():
                continue
            first, _, last = part.partition("-")
            out.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a vbucket list such as 1,2 or 0-63"
        ) from None
    if not out or any(vb < 0 or vb >= MAX_VBUCKETS for vb in out):
        raise argparse.ArgumentTypeError(f"{text!r}: vbuckets are numbers from 0 to 65535")
    return out
