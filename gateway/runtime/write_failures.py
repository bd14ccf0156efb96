"""Failed writes of the UPR front's log, made visible beyond the log line.

The ingest logs each log write the file system refuses (``LogWriteError``: a
full disk, a quota, a file size limit), acknowledges nothing of it, writes it
again after a backoff, and counts it with ``UprLogStats.note_write_failure``
by the errno name ``errno_name`` gives
(``tapupr_upr_front_log_write_failures_total{errno}``); the message stays for
``/readyz`` until the log grows again.
"""

from __future__ import annotations

import errno
import os

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
