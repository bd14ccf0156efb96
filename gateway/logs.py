"""Logging set-up shared by the long-running commands."""

from __future__ import annotations

import logging


def configure(verbosity: int) -> None:
    level = logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )


def read_users(path: str) -> dict[str, str]:
    """``user:password`` per line; blank lines and ``#`` comments ignored."""
    users: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, password = line.partition(":")
            if not sep or not user:
                raise ValueError(f"{path}:{number}: expected user:password")
            users[user] = password
    return users


def os_error_in(exc: BaseException) -> OSError | None:
    """The ``OSError`` (a port in use, an unreachable address) inside ``exc`` or its
    exception groups, so a command can report it in one line instead of a traceback."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = os_error_in(inner)
            if found is not None:
                return found
    return None
