"""Start-up checks that turn an unusable listener, path or upstream into one clear line.

Every message names the option, the address or path, and the reason, e.g.
``--metrics-listen 127.0.0.1:9464: address already in use (another process
listens there)``; the commands print it as ``serve: <message>`` and exit 1.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import trio

from gateway.metrics.health import UpstreamHealth
from gateway.runtime.logs import Repeats, os_error_in
from gateway.runtime.logs import describe as describe  # the commands name it from here

log = logging.getLogger("gateway.cli.serve")

T = TypeVar("T")

CHECK_TIMEOUT = 10.0
WATCH_INTERVAL = 5.0
"""Seconds between checks of an upstream that answers (``/readyz`` follows it)."""


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


LOCK_NAME = "lock"
"""The file in a state directory whose ``flock`` marks the process using it."""


@contextlib.contextmanager
def lock_directory(option: str, path: Path) -> Iterator[None]:
    """Hold ``path`` for this process only: a second process on the same state would
    take the first one's live logs for a crash's and write over them.

    ``flock`` goes with the process, so a SIGKILL leaves no stale lock behind."""
    lock_path = path / LOCK_NAME
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StartupError(f"{option} {path}: cannot create {LOCK_NAME}: {describe(exc)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise StartupError(
                f"{option} {path}: in use by another tap-upr-gateway process{who}; "
                "give each process its own directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


VERSION_REQUEST = bytes([0x80, 0x0B]) + bytes(22)
"""A memcached binary VERSION request: every 2.x and 3.0 node answers it, before SASL too."""


async def probe_memcached(stream: trio.abc.Stream) -> str | None:
    """None if the peer answers VERSION in the memcached binary protocol, else why not.

    A TCP connect alone takes a REST port, an HTTP proxy or a TLS-only port for an
    upstream; the fronts would then fail on every client's connection instead."""
    await stream.send_all(VERSION_REQUEST)
    first = await _receive_up_to(stream, 24)
    if first[:1] == b"\x81" and len(first) == 24:
        # Read the answer whole: closing on unread bytes resets the connection, which
        # the upstream would log as a lost connection every WATCH_INTERVAL.
        await _receive_up_to(stream, int.from_bytes(first[8:12], "big"))
        return None
    if not first:
        return "closed the connection without answering a memcached VERSION"
    if first[:1] == b"\x16":
        return "speaks TLS, not plain memcached (give --upstream-tls)"
    if first[:4] == b"HTTP":
        return "speaks HTTP, not the memcached binary protocol (the data port is 11210)"
    return f"does not speak the memcached binary protocol (first byte 0x{first[0]:02x})"


async def watch_upstream(
    option: str,
    address: tuple[str, int],
    *,
    health: UpstreamHealth | None = None,
    first_retry: float = 1.0,
    max_retry: float = 30.0,
    interval: float | None = None,
    probe: bool = True,
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
    repeats = Repeats()
    while True:
        reason: str | None = None
        try:
            with trio.fail_after(CHECK_TIMEOUT):
                stream = await trio.open_tcp_stream(*address)
        except (OSError, trio.TooSlowError) as exc:
            reason = describe(exc, address[0]) if isinstance(exc, OSError) else "timed out"
        else:
            async with stream:
                if probe:
                    reason = await _probe_within(stream)
        if reason is not None:
            if health is not None:
                health.record(False, reason)
            level, note = repeats.level(reason)
            log.log(level, "%s %s is unreachable: %s; checking again in %.0fs%s",
                    option, show(address), reason, delay, note)  # fmt: skip
            warned = True
            await trio.sleep(delay)
            delay = min(delay * 2, max_retry)
            continue
        if health is not None:
            health.record(True, "answers")
        if warned:
            log.info("%s %s answers again", option, show(address))
            warned = False
            repeats.reset()
        if health is None:
            return
        delay = first_retry
        await trio.sleep(WATCH_INTERVAL if interval is None else interval)


async def _receive_up_to(stream: trio.abc.Stream, size: int) -> bytes:
    """``size`` bytes, or fewer if the peer closes first."""
    data = b""
    while len(data) < size:
        more = await stream.receive_some(size - len(data))
        if not more:
            break
        data += more
    return data


async def _probe_within(stream: trio.abc.Stream) -> str | None:
    try:
        with trio.fail_after(CHECK_TIMEOUT):
            return await probe_memcached(stream)
    except trio.TooSlowError:
        return (
            f"accepts connections but does not answer a memcached VERSION "
            f"within {CHECK_TIMEOUT:.0f}s (not a memcached data port?)"
        )
    except (OSError, trio.BrokenResourceError) as exc:
        return "connection lost during the check: " + (
            describe(exc) if isinstance(exc, OSError) else "reset by the peer"
        )
