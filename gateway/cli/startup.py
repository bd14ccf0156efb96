"""Start-up checks that turn an unusable listener, path or upstream into one clear line.

Every message names the option, the address or path, and the reason, e.g.
``--metrics-listen 127.0.0.1:9464: address already in use (another process
listens there)``; the commands print it as ``serve: <message>`` and exit 1.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pwd
import re
import stat
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import trio

from gateway.metrics.health import UpstreamHealth
from gateway.runtime.logs import Repeats, os_error_in
from gateway.runtime.logs import describe as describe  # the commands name it from here
from gateway.runtime.logs import describe_file as describe_file

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
    """Create ``path`` (private, 0700) if missing, or check an existing one: this
    user's, writable, and private (one open to others is made 0700 with a warning,
    unless it is shared, such as /tmp, or holds files the gateway did not make).

    Every refusal is one ``StartupError`` line naming the option, the path and why."""
    if path.exists() and not path.is_dir():
        raise StartupError(f"{option} {path}: exists and is not a directory")
    in_the_way = _file_in_the_way(path)
    if in_the_way is not None:
        raise StartupError(f"{option} {path}: {in_the_way} is a file, not a directory")
    if not path.exists():
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise StartupError(
                f"{option} {path}: cannot create it: {_creation_failure(exc, path)}"
            ) from None
    info = path.stat()
    if info.st_uid != os.geteuid():
        owner, me = _user_name(info.st_uid), _user_name(os.geteuid())
        raise StartupError(
            f"{option} {path}: owned by {owner} while this process runs as {me}: run as "
            f"{owner.split()[0]}, or give a directory {me.split()[0]} owns (files written "
            f"now would be {me.split()[0]}'s, unreadable to the owner)"
        )
    _check_writable(option, path)
    mode = info.st_mode & 0o7777
    if mode & 0o077:
        _make_private(option, path, mode)
    _check_contents(option, path)
    return path


def _check_contents(option: str, path: Path) -> None:
    """What an earlier run left (or a restore, or a run as another user): files of
    another user are refused (the gateway could not rewrite them, and fails later
    mid-serve); files open to others are made 0600 (directories 0700), one warning."""
    me = os.geteuid()
    foreign: list[tuple[Path, int]] = []
    opened: list[tuple[Path, int]] = []
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(root, name)
            try:
                info = entry.lstat()
            except FileNotFoundError:  # removed meanwhile (by a process holding the lock)
                continue
            if stat.S_ISLNK(info.st_mode):
                continue
            if info.st_uid != me:
                foreign.append((entry, info.st_uid))
            elif info.st_mode & 0o077:
                opened.append((entry, info.st_mode))
    if foreign:
        first, uid = foreign[0]
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        me_name = _user_name(me).split()[0]
        raise StartupError(
            f"{option} {path}: {first.relative_to(path)}{more} {'are' if more else 'is'} "
            f"owned by {_user_name(uid)}, not by {_user_name(me)} (this process): run as "
            f"their owner, or chown -R {me_name} {path}"
        )
    for entry, mode in opened:
        try:
            entry.chmod(0o700 if stat.S_ISDIR(mode) else 0o600)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StartupError(
                f"{option} {path}: {entry.relative_to(path)} is open to other users (mode "
                f"{mode & 0o7777:o}) and cannot be made private: {describe_file(exc)}"
            ) from None
    if opened:
        first, mode = opened[0][0], opened[0][1] & 0o7777
        more = f" and {len(opened) - 1} more" if len(opened) > 1 else ""
        log.warning(
            "%s %s: %s (mode %o)%s open to other users: made private (files 0600, "
            "directories 0700)",
            option, path, first.relative_to(path), mode, f"{more} were" if more else " was",
        )  # fmt: skip


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` if it is not a directory."""
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _creation_failure(error: OSError, path: Path) -> str:
    parent = path.absolute().parent
    if error.errno == errno.ENOENT and parent.is_dir():
        # /proc, /sys and the like: the parent is there, its file system takes nothing
        return f"{parent} does not take new directories (its file system refuses them)"
    return describe_file(error)


def _check_writable(option: str, path: Path) -> None:
    """Create and remove a file: ``os.access`` says yes to root on a read-only mount."""
    probe = path / f".write-check-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as exc:
        reason = describe_file(exc)
        if exc.errno in (errno.EACCES, errno.EPERM):
            reason += ": not writable by this user"
        raise StartupError(f"{option} {path}: cannot write in it: {reason}") from None


def _make_private(option: str, path: Path, mode: int) -> None:
    if mode & stat.S_ISVTX:
        raise StartupError(
            f"{option} {path}: shared by every user (mode {mode:o}, as /tmp is): give the "
            f"gateway a directory of its own, e.g. {path / 'tap-upr-gateway'}"
        )
    entries = sorted(entry.name for entry in path.iterdir())
    if entries and not any(_OURS.fullmatch(name) for name in entries):
        raise StartupError(
            f"{option} {path}: open to other users (mode {mode:o}) and holds files the "
            f"gateway did not make (e.g. {entries[0]!r}): give it a directory of its own, "
            f"e.g. {path / 'tap-upr-gateway'}"
        )
    try:
        path.chmod(0o700)
    except OSError as exc:
        raise StartupError(
            f"{option} {path}: open to other users (mode {mode:o}) and cannot be made "
            f"private: {describe_file(exc)}"
        ) from None
    log.warning("%s %s was open to other users (mode %o): made it 0700", option, path, mode)


_OURS = re.compile(
    r"lock|store\.journal|upr-front-logs\.msgpack|tap-front-state\.msgpack|vb-\d{4}"
    r"|.*\.tucap|tap|upr"
)
"""Names the gateway writes in the directories it is given (state, node data, captures):
a directory holding one is the gateway's own, and may be made private."""


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


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
        raise StartupError(
            f"{option} {path}: cannot create {LOCK_NAME}: {describe_file(exc)}"
        ) from None
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


def not_memcached(exc: BaseException) -> str | None:
    """Why a peer that answered with a bad magic byte is not a memcached data port,
    in the words the upstream check uses; None for any other error."""
    from adapters.errors import ProtocolError

    if not isinstance(exc, ProtocolError) or exc.field != "magic":
        return None
    first = exc.value if isinstance(exc.value, int) else -1
    if first == ord("H"):
        return (
            "speaks HTTP, not the memcached binary protocol (a metrics or REST port? "
            "a node's data port is 11210)"
        )
    if first in (0x15, 0x16):
        return "speaks TLS, not plain memcached (give --tls)"
    return f"does not speak the memcached binary protocol (first byte 0x{first & 0xFF:02x})"


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
