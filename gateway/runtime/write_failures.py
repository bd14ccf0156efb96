"""Failed writes of the UPR front's log, made visible beyond the log line.

The ingest logs each log write the file system refuses (``LogWriteError``: a
full disk, a quota, a file size limit), acknowledges nothing of it and writes
it again after a backoff. ``watch_write_failures`` puts a handler on the
ingest's logger that counts each in ``UprLogStats.write_failures_total`` by
errno name (``tapupr_upr_front_log_write_failures_total{errno}``) and keeps
the message, which ``/readyz`` shows until the log grows again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator

from gateway.fronts.upr.segment_file import LogWriteError
from gateway.metrics.figures import UprLogStats

INGEST_LOGGER = "gateway.fronts.upr.ingest"


_BY_STRERROR = {os.strerror(number): name for number, name in errno.errorcode.items()}


def errno_name(failure: BaseException) -> str:
    """``ENOSPC`` for the ``OSError`` behind ``failure``, else for the reason its
    message gives (``...: No space left on device; ...``), else ``unknown``.

    The message is the fallback because the ingest re-raises the failure out of
    its task group ``from None``, which drops the ``OSError`` it was raised from."""
    seen: BaseException | None = failure
    for _ in range(8):  # a short chain: the error, what it was raised from
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno is not None:
            return errno.errorcode.get(seen.errno, str(seen.errno))
        seen = seen.__cause__ or seen.__context__
    text = str(failure)
    for reason, name in _BY_STRERROR.items():
        if f": {reason};" in text or text.endswith(f": {reason}"):
            return name
    return "unknown"


class _WriteFailures(logging.Handler):
    def __init__(self, upr_log: UprLogStats) -> None:
        super().__init__(logging.ERROR)
        self.upr_log = upr_log

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        for arg in args:
            if isinstance(arg, LogWriteError):
                self.upr_log.note_write_failure(errno_name(arg), str(arg))
                return


@contextlib.contextmanager
def watch_write_failures(upr_log: UprLogStats) -> Iterator[None]:
    handler = _WriteFailures(upr_log)
    logger = logging.getLogger(INGEST_LOGGER)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
