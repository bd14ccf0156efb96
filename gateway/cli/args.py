"""Argument types shared by the subcommands: each rejects a bad value at parse time.

argparse turns the ``ArgumentTypeError`` into one line naming the option
(``argument --vbucket-count: 0 is not between 1 and 65536``) and exit status 2,
so no bad value reaches the code that would fail later with a traceback.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any

MAX_VBUCKETS = 65536
"""vbucket ids are 16-bit on the wire."""


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` with a host and a port from 0 to 65535."""
    from gateway.io.listen import parse_hostport

    scheme, colon_slashes, rest = text.partition("://")
    if colon_slashes:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write HOST:PORT without the {scheme}:// part, e.g. {rest.rstrip('/')}"
        )
    if text.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} has no host: write HOST:PORT, e.g. 127.0.0.1:{text} (this machine only) "
            f"or 0.0.0.0:{text} (every interface)"
        )
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


count = int_between(0)
positive = int_between(1)
_VBUCKET_LIST = re.compile(r"\s*\d+\s*(?:[-,]\s*\d*\s*)+")
"""``0,1,5``, ``0-3``, ``64,``: what a list of vbucket ids looks like (``-5`` does not)."""


def vbucket_count(text: str) -> int:
    """How many vbuckets a node has. ``--vbuckets`` takes a list of ids in ``move`` and
    ``capture``, so a list here is that mix-up, said as such rather than as a bad number."""
    if _VBUCKET_LIST.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a list of vbucket ids, but --vbucket-count takes how many vbuckets "
            "the node has (e.g. 64); lists go to --vbuckets of move and capture"
        )
    return int_between(1, MAX_VBUCKETS)(text)


vbucket_count.__name__ = "integer"
DEPRECATION_NOTES = "deprecation_notes"
"""The namespace attribute where renamed options leave their warnings; the commands
log them once logging is set up (``gateway.runtime.logs.configure_from``)."""


class RenamedOption(argparse.Action):
    """An old option name still accepted (hidden from --help) with a one-line warning
    naming the new one: configurations written for the old name keep working."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, new_name: str, **kwargs: Any
    ) -> None:
        kwargs.setdefault("help", argparse.SUPPRESS)
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.new_name = new_name

    def notice(self, command: str, value: object, where: str | None = None) -> str:
        old = self.option_strings[0]
        source = f" ({where})" if where else ""
        return (
            f"{command}: {old} {value}{source} is deprecated: write {self.new_name} {value} "
            f"({old} is a list of vbucket ids in move and capture)"
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        command = parser.prog.rpartition(" ")[2]
        notes = [*getattr(namespace, DEPRECATION_NOTES, []), self.notice(command, values)]
        setattr(namespace, DEPRECATION_NOTES, notes)


def add_vbucket_count(parser: argparse._ActionsContainer, help_text: str) -> None:
    """``--vbucket-count N``, and ``--vbuckets N``, its old name in serve and node."""
    parser.add_argument(
        "--vbucket-count", type=vbucket_count, default=64, metavar="N", help=help_text
    )
    parser.add_argument(
        "--vbuckets",
        dest="vbucket_count",
        type=vbucket_count,
        metavar="N",
        action=RenamedOption,
        new_name="--vbucket-count",
    )


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
