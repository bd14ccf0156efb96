"""Logging set-up shared by the long-running commands.

Lines carry ISO-8601 timestamps with the time zone. ``--log-format json``
writes one JSON object per line (time, level, logger, message and the
connection fields) for log shippers. Connection fields come from a context
variable: the listener binds ``peer`` (and the listener's name) for each
accepted connection, the protocol code adds ``connection`` once the peer
names itself (TAP CONNECT, UPR OPEN); trio tasks inherit the context of the
task that started them, so every line logged on a connection's behalf
carries them without each call passing them.
"""

from __future__ import annotations

import argparse
import contextvars
import errno
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

LEVELS = ("debug", "info", "warning", "error")
_FIELDS: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "log_fields", default=()
)


@contextmanager
def bind(**fields: str) -> Iterator[None]:
    """Add ``fields`` to every line logged in this task and the tasks it starts."""
    token = _FIELDS.set(_merged(fields))
    try:
        yield
    finally:
        _FIELDS.reset(token)


def name_connection(name: str) -> None:
    """The peer named itself: later lines of this task (and its new tasks) carry it."""
    _FIELDS.set(_merged({"connection": name}))


def _merged(fields: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple({**dict(_FIELDS.get()), **fields}.items())


def _iso(created: float) -> str:
    local = time.localtime(created)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", local)
    offset = time.strftime("%z", local)
    return f"{stamp}.{int(created % 1 * 1000):03d}{offset[:3]}:{offset[3:]}"


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.fields = dict(_FIELDS.get())
        return True


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, str] = getattr(record, "fields", {})
        context = "".join(f" {k}={v}" for k, v in fields.items())
        line = f"{_iso(record.created)} {record.levelname:<7} {record.name}:{context} "
        line += record.getMessage()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def add_logging_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less logging")
    parser.add_argument(
        "--log-level", choices=LEVELS, help="log level (overrides -v/-q; default info)"
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text lines, or one JSON object per line for log shippers (default text)",
    )


def configure_from(args: argparse.Namespace) -> None:
    """``configure`` from the options ``add_logging_options`` added."""
    configure(
        args.verbose - args.quiet,
        level=getattr(args, "log_level", None),
        fmt=getattr(args, "log_format", "text"),
    )
    # Old option names still accepted (gateway.cli.args.RenamedOption): said once,
    # in the log's own format, so that configurations get updated.
    for note in getattr(args, "deprecation_notes", ()):
        logging.getLogger("gateway.cli").warning("%s", note)


def configure(verbosity: int, *, level: str | None = None, fmt: str = "text") -> None:
    if level is not None:
        numeric = getattr(logging, level.upper())
    else:
        numeric = (
            logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
        )
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


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


class Repeats:
    """The level for a failure that may repeat for hours (an upstream down): WARNING
    the first time and whenever the message changes, then at most once per
    ``every`` seconds (with how many were quieter since); DEBUG in between.

    A retry loop backing off to a few seconds otherwise writes ~1,000 identical
    warnings an hour, burying whatever else happens."""

    def __init__(self, every: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last = ""
        self._shown_at = 0.0
        self._quiet = 0

    def level(self, key: str) -> tuple[int, str]:
        """(the level for this occurrence of failure ``key``, a note to append to it)."""
        now = self.clock()
        if key != self._last or now - self._shown_at >= self.every:
            note = f" ({self._quiet} more since, at debug level)" if self._quiet else ""
            self._last, self._shown_at, self._quiet = key, now, 0
            return logging.WARNING, note
        self._quiet += 1
        return logging.DEBUG, ""

    def reset(self) -> None:
        """The failure is over: the next one is news."""
        self._last, self._quiet = "", 0


_REASONS = {
    errno.EADDRINUSE: "address already in use (another process listens there)",
    errno.EADDRNOTAVAIL: "not an address of this machine",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.ECONNREFUSED: "connection refused (nothing listens there)",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.ETIMEDOUT: "timed out",
}


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


_FILE_REASONS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the process's file size limit, ulimit -f)",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.ENOENT: "no such file or directory",
    errno.EIO: "input/output error (the disk or its file system failed)",
}


def describe_file(error: OSError) -> str:
    """Why a file operation failed, with the errno name an operator can search for
    (``describe`` is for addresses: its EACCES is about privileged ports)."""
    name = errno.errorcode.get(error.errno or 0)
    reason = _FILE_REASONS.get(error.errno or 0, error.strerror or str(error))
    return f"{reason} ({name})" if name else reason
