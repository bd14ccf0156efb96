"""``CaptureRecorder``: record item events from a trio hot path without blocking it.

Theory of operation. ``record_item``/``record_marker`` build a record and
append it to an in-memory buffer: no I/O, no await. A writer task
(``run``) takes the whole buffer whenever it holds ``batch_records``
records or ``flush_interval`` seconds have passed, and hands it to a
``SegmentWriter`` in a worker thread (``trio.to_thread.run_sync``), so the
disk never stalls the event loop. While one batch is being written the
next fills up. The buffer is bounded (``max_buffered`` records): once full,
new records are dropped and counted in ``dropped`` (a warning is logged
on the first drop and then at most every ``WARN_INTERVAL`` seconds), so a
disk that cannot keep up costs completeness of the capture, never the
stream. ``close`` flushes what is buffered and closes the segment.

Run it either with ``nursery.start(recorder.run)`` and ``await
recorder.close()``, or as ``async with open_recorder(...) as recorder``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import trio

from gateway.tools.capture.records import CaptureRecord, Kind, item_record, marker_record
from gateway.tools.capture.segments import DEFAULT_MAX_SEGMENT_BYTES, SegmentWriter

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED = 200_000
DEFAULT_BATCH_RECORDS = 8192
DEFAULT_FLUSH_INTERVAL = 0.25
WARN_INTERVAL = 10.0
CLOSE_TIMEOUT = 30.0

Side = Literal["tap", "upr"]
Direction = Literal["received", "sent"]


class CaptureRecorder:
    """Records of one connection and direction, written to size-rotated segments."""

    def __init__(
        self,
        directory: Path,
        *,
        side: Side,
        connection: str,
        direction: Direction,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        batch_records: int = DEFAULT_BATCH_RECORDS,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be positive")
        self.writer = SegmentWriter(
            Path(directory),
            side=side,
            connection=connection,
            direction=direction,
            max_segment_bytes=max_segment_bytes,
            extra=extra,
        )
        self.connection = connection
        self.max_buffered = max_buffered
        self.batch_records = max(1, min(batch_records, max_buffered))
        self.flush_interval = flush_interval
        self.recorded = 0
        """Records accepted into the buffer."""
        self.dropped = 0
        """Records refused because the buffer was full (the disk fell behind)."""
        self.write_errors = 0
        self._buffer: list[CaptureRecord] = []
        self._wake = trio.Event()
        self._closing = False
        self._sealed = False
        """The last flush began: later records are dropped (and counted)."""
        self._running = False
        self._done = trio.Event()
        self._last_warning = -WARN_INTERVAL
        self.observer: Callable[[CaptureRecord], None] | None = None
        """Called with every record offered (a two-sided capture tracks its cut with it)."""
        self._dropped_at_warning = 0

    # -- hot path ---------------------------------------------------------------

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def written(self) -> int:
        return self.writer.records_written

    def record(self, record: CaptureRecord) -> bool:
        """Buffer one record; ``False`` (and counted in ``dropped``) if the buffer is full."""
        buffer = self._buffer
        if self.observer is not None:
            self.observer(record)
        if len(buffer) >= self.max_buffered or self._sealed:
            self._drop()
            return False
        buffer.append(record)
        self.recorded += 1
        if len(buffer) >= self.batch_records:
            self._wake.set()
        return True

    def record_item(
        self,
        vbucket: int,
        key: bytes,
        kind: Kind | str,
        *,
        by_seqno: int | None,
        rev_seqno: int | None,
        cas: int,
        flags: int = 0,
        expiration: int = 0,
        value: bytes | None = None,
        checkpoint_id: int | None = None,
        snapshot: tuple[int, int] | None = None,
        arrival: float | None = None,
    ) -> bool:
        """Record an item event (``arrival`` defaults to now, wall clock)."""
        return self.record(
            item_record(
                vbucket,
                key,
                kind,
                by_seqno=by_seqno,
                rev_seqno=rev_seqno,
                cas=cas,
                flags=flags,
                expiration=expiration,
                value=value,
                checkpoint_id=checkpoint_id,
                snapshot=snapshot,
                arrival=time.time() if arrival is None else arrival,
            )
        )

    def record_marker(
        self,
        vbucket: int,
        kind: Kind | str,
        *,
        checkpoint_id: int | None = None,
        snapshot: tuple[int, int] | None = None,
        flags: int = 0,
        arrival: float | None = None,
    ) -> bool:
        """Record a boundary: snapshot, checkpoint start/end, backfill start/end, stream end."""
        return self.record(
            marker_record(
                vbucket,
                kind,
                checkpoint_id=checkpoint_id,
                snapshot=snapshot,
                flags=flags,
                arrival=time.time() if arrival is None else arrival,
            )
        )

    def _drop(self) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_INTERVAL:
            log.warning(
                "capture %s: buffer of %d records full, the disk is not keeping up: "
                "%d records dropped so far (%d since the last warning)",
                self.connection,
                self.max_buffered,
                self.dropped,
                self.dropped - self._dropped_at_warning,
            )
            self._last_warning = now
            self._dropped_at_warning = self.dropped

    # -- writer -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write batches until ``close``; start with ``nursery.start``.

        Cancelled (Ctrl-C, SIGTERM, a nursery ending), it still flushes what
        is buffered and closes the segment cleanly before it returns.
        """
        self._running = True
        task_status.started()
        try:
            while not self._closing:
                with trio.move_on_after(self.flush_interval):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self._flush()
        finally:
            self._closing = True
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await self._finish()
            self._done.set()

    async def _finish(self) -> None:
        self._sealed = True
        await self._flush()
        try:
            await trio.to_thread.run_sync(self.writer.close)
        except OSError as exc:
            self.write_errors += 1
            log.error("capture %s: cannot close segment: %s", self.connection, exc)

    async def _flush(self) -> None:
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        try:
            await trio.to_thread.run_sync(self.writer.write, batch)
        except OSError as exc:
            # A full or failing disk: say so and keep the stream going without a capture.
            self.write_errors += 1
            self.dropped += len(batch)
            log.error("capture %s: cannot write segment: %s", self.connection, exc)

    async def close(self) -> None:
        """Flush everything buffered and close the segment (shielded, time-limited)."""
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            if self._done.is_set():
                return
            self._closing = True
            if self._running:
                self._wake.set()
                await self._done.wait()
            else:
                await self._finish()
                self._done.set()

    def stats(self) -> dict[str, int]:
        return {
            "recorded": self.recorded,
            "written": self.written,
            "dropped": self.dropped,
            "buffered": self.buffered,
            "segments": len(self.writer.paths),
            "bytes": self.writer.bytes_written,
        }


@asynccontextmanager
async def open_recorder(
    directory: Path, *, side: Side, connection: str, direction: Direction, **options: Any
) -> AsyncIterator[CaptureRecorder]:
    """A running recorder, flushed and closed on exit."""
    recorder = CaptureRecorder(
        directory, side=side, connection=connection, direction=direction, **options
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        try:
            yield recorder
        finally:
            await recorder.close()
