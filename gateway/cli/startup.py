"""Start-up checks that turn an unusable listener, path or upstream into one clear line.

Every message names the option, the address or path, and the reason, e.g.
``--metrics-listen 127.0.0.1:9464: address already in use (another process
listens there)``; the commands print it as ``serve: <message>`` and exit 1.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import trio

from gateway.metrics.health import UpstreamHealth
from gateway.runtime.logs import os_error_in

log = logging.getLogger("gateway.cli.serve")

T = TypeVar("T")

CHECK_TIMEOUT = 10.0
WATCH_INTERVAL = 5.0
"""Seconds between checks of an upstream that answers (``/readyz`` follows it)."""

_REASONS = {
    errno.EADDRINUSE: "address already in use (another process listens there)",
    errno.EADDRNOTAVAIL: "not an address of this machine",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.ECONNREFUSED: "connection refused (nothing listens there)",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.ETIMEDOUT: "timed out",
}


class StartupError(Exception):
    """Something the command was given cannot be used; the message is the whole story."""


def startup_error_in(exc: BaseException) -> StartupError | None:
    """The ``StartupError`` inside ``exc`` or its exception groups."""
    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = startup_error_in(inner)
            if found is not None:
                return found
    return None


def describe(error: OSError, host: str | None = None) -> str:
    """Why ``error`` happened, in words an operator can act on."""
    if error.errno is None and error.__cause__ is not None:
        # trio's open_tcp_stream: "all attempts to connect ... failed", the
        # reasons in the cause
        inner = os_error_in(error.__cause__)
        if inner is not None and inner is not error:
            return describe(inner, host)
    if isinstance(error, socket.gaierror):
        return f"cannot resolve host {host!r}: {error.strerror}" if host else str(error.strerror)
    if error.errno in _REASONS:
        return _REASONS[error.errno]
    return error.strerror or str(error)


def show(address: tuple[str, int]) -> str:
    return "{}:{}".format(*address)


async def start_listener(
    option: str,
    address: tuple[str, int],
    start: Callable[[], Awaitable[T]],
) -> T:
    """Run ``start`` (a ``nursery.start`` of a listener); name ``option`` if it fails."""
    try:
        return await start()
    except (OSError, BaseExceptionGroup) as exc:
        failure = os_error_in(exc)
        if failure is None:
            raise
        raise StartupError(f"{option} {show(address)}: {describe(failure, address[0])}") from None


def prepare_directory(option: str, path: Path) -> Path:
    """Create ``path`` (private, 0700) if missing; refuse a file or an unwritable place."""
    if path.exists() and not path.is_dir():
        raise StartupError(f"{option} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StartupError(f"{option} {path}: cannot create it: {describe(exc)}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"{option} {path}: not writable by this user")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        try:
            path.chmod(0o700)
        except OSError as exc:
            raise StartupError(
                f"{option} {path}: open to other users (mode {mode:o}) and cannot be made "
                f"private: {describe(exc)}"
            ) from None
        log.warning("%s %s was open to other users (mode %o): made it 0700", option, path, mode)
    return path


async def watch_upstream(
    option: str,
    address: tuple[str, int],
    *,
    health: UpstreamHealth | None = None,
    first_retry: float = 1.0,
    max_retry: float = 30.0,
    interval: float | None = None,
) -> None:
    """Check at start-up that ``address`` answers; warn loudly and retry until it does.

    The fronts connect on their own (per client, or their ingest); this makes
    an unreachable upstream visible in the log from the first second. With
    ``health`` it keeps checking every ``interval`` seconds (``WATCH_INTERVAL``) as long as it
    runs, records every result there (``/readyz`` and the status page read
    it), and logs when the upstream goes away and when it answers again.
    """
    delay = first_retry
    warned = False
    while True:
        try:
            with trio.fail_after(CHECK_TIMEOUT):
                stream = await trio.open_tcp_stream(*address)
        except (OSError, trio.TooSlowError) as exc:
            reason = describe(exc, address[0]) if isinstance(exc, OSError) else "timed out"
            if health is not None:
                health.record(False, reason)
            log.warning(
                "%s %s is unreachable: %s; checking again in %.0fs",
                option,
                show(address),
                reason,
                delay,
            )
            warned = True
            await trio.sleep(delay)
            delay = min(delay * 2, max_retry)
            continue
        await stream.aclose()
        if health is not None:
            health.record(True, "answers")
        if warned:
            log.info("%s %s answers again", option, show(address))
            warned = False
        if health is None:
            return
        delay = first_retry
        await trio.sleep(WATCH_INTERVAL if interval is None else interval)
