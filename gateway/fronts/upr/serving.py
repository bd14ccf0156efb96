"""One serving task per UPR connection for its caught-up streams.

Theory of operation. A ``LogStream`` that caught up with its log (and is on
the fast path: released dialect, no takeover, no capture) hands itself to
its connection's ``LiveServer`` (``follow``) and sleeps. The server watches
each followed vbucket's log (``VbLog.watch``): a publish only marks the
stream as having news and sets the server's one event, so a publish round
that touched 40 vbuckets wakes one task per connection, not 40.

Once woken, the server waits for room (the flow-control window and the
outbox, as a stream does before each read), then walks the streams with
news in the order they got it: each reads its log's in-memory tail from its
position, frames the items from the tail's record bytes (``BatchCut``:
markers and items, the bytes a stream's own task sends) and its part goes
into one buffer, then one send
for the connection. The keys and values read in one pass are bounded by the
budget (at most ``BATCH_BYTES``), so a pass holds at most one batch's
framing beyond the room; a stream left with more goes to the back of the
line. With flow control, whole messages go while the window has room (the
last may overshoot, as a producer stops only once it is full); the rest of
a stream's batch waits in the server, and goes first once acks make room,
so each stream's messages stay in order.

A stream goes back to its own task (``follow`` returns) when the server has
nothing to do for it: it reached its end seqno (the task sends STREAM_END
after the items, on the same connection), it fell behind the in-memory tail
(its task reads the disk), a compaction is swapping the log's files, or the
connection's dialect or capture now needs the event path. A closed stream
(CLOSE_STREAM, a takeover elsewhere) is cancelled in ``follow`` and the
server forgets it: nothing more of it is sent.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

import trio

from adapters.translate.log_to_upr_fast import BatchCut, EncodedBatch
from gateway.fronts.upr.streams import BATCH, BATCH_BYTES, count_sent

if TYPE_CHECKING:
    from gateway.fronts.upr.producer import UprConnection
    from gateway.fronts.upr.streams import LogStream


class _Rest:
    """What the window held back of a stream's batch: sent first once there is room."""

    __slots__ = ("encoded", "offset")

    def __init__(self, encoded: EncodedBatch, offset: int) -> None:
        self.encoded = encoded
        self.offset = offset


class LiveServer:
    """Serves the caught-up streams of one connection in one task."""

    def __init__(self, conn: UprConnection) -> None:
        self.conn = conn
        self._news: dict[LogStream, None] = {}
        """Streams with items to send, in the order they got them (an ordered set)."""
        self._rest: dict[LogStream, _Rest] = {}
        self._released: dict[LogStream, trio.Event] = {}
        """The streams followed, each with the event its own task sleeps on."""
        self._wake = trio.Event()
        self._running = False
        self.passes = 0
        """Passes that sent something (one send each)."""

    @property
    def following(self) -> int:
        return len(self._released)

    async def follow(self, stream: LogStream) -> None:
        """Serve ``stream`` from here until it needs its own task again."""
        if not self._running:
            nursery = self.conn._nursery
            assert nursery is not None
            self._running = True
            nursery.start_soon(self._run)
        released = self._released[stream] = trio.Event()
        unwatch = stream.vblog.watch(partial(self._on_news, stream))
        try:
            if stream.vblog.high_seqno > stream.position:
                self._on_news(stream)
            await released.wait()
        finally:
            unwatch()
            del self._released[stream]
            self._news.pop(stream, None)
            self._rest.pop(stream, None)  # cancelled: nothing more of it goes

    def _on_news(self, stream: LogStream) -> None:
        self._news[stream] = None
        self._wake.set()

    def _release(self, stream: LogStream) -> None:
        self._news.pop(stream, None)
        released = self._released.get(stream)
        if released is not None:
            released.set()

    async def _run(self) -> None:
        conn = self.conn
        while True:
            if not self._news and not self._rest:
                if self._wake.is_set():
                    self._wake = trio.Event()
                await self._wake.wait()
                continue
            # One yield per pass, before the room is measured (as a stream's read).
            await trio.lowlevel.checkpoint()
            budget = await conn.send_budget(waiting=len(self._news) + len(self._rest))
            self._pass(budget)

    def _pass(self, budget: int) -> None:
        """Read, frame and send in one write what the streams with news have, within
        ``budget`` bytes of keys and values (the least of the window's and the outbox's
        room)."""
        conn = self.conn
        if conn.draft or conn.recording is not None:
            for stream in list(self._news):
                self._release(stream)  # the event path, in their own tasks
            return
        window = conn.window
        room = window.room  # None: no flow control
        flow_control = room is not None
        in_flight = conn._in_flight
        parts: list[bytes] = []
        news, rest = self._news, self._rest
        left = min(BATCH_BYTES, budget)
        markers = items = deletions = expirations = 0
        # What the window held back goes first: those streams' next messages.
        for stream, held in list(rest.items()):
            if room is not None and room <= 0:
                break
            encoded = held.encoded
            data = encoded.data
            end, count, last = _cut(stream, data, held.offset, room)
            part = data[held.offset : end]
            window.sent(len(part))
            if room is not None:
                room -= len(part)
            left -= len(part)
            parts.append(part)
            if count:
                if flow_control:
                    in_flight.append((window.total_sent, stream.vbucket, last, encoded.arrival,
                                      count))  # fmt: skip
                stream.sent_part(count, last)
            if end < len(data):
                held.offset = end
                continue
            del rest[stream]
            stream.sent_whole(encoded, flow_control)
            markers += encoded.markers
            items += encoded.items
            deletions += encoded.deletions
            expirations += encoded.expirations
            news[stream] = None  # may have more: look again
        while news and left > 0 and (room is None or room > 0):
            stream = next(iter(news))
            del news[stream]
            if stream in rest or stream.end_reason is not None:
                continue
            vblog = stream.vblog
            high = vblog.high_seqno
            stream.progress.upstream_high_seqno = high
            end_seqno = stream.end_seqno
            upto = high if high < end_seqno else end_seqno
            position = stream.position
            if position >= upto:
                if position >= end_seqno:
                    self._release(stream)  # its task ends it
                continue
            if vblog.swapping or not vblog.in_memory(position):
                self._release(stream)  # its task reads the disk
                continue
            # Framed from the tail's record bytes, as a stream's own read does.
            cut = BatchCut(stream.fast_encoder(), position, upto, BATCH, left)
            vblog.read_memory(position, upto, cut)
            encoded = cut.finish()
            if not encoded.items:
                stream.position = upto  # the rest were gaps
                news[stream] = None
                continue
            data = encoded.data
            size = len(data)
            if size > stream.peak_batch_bytes:
                stream.peak_batch_bytes = size
            if room is None or size <= room:
                end, count, last = size, encoded.items, encoded.last
            else:
                end, count, last = _cut(stream, data, 0, room)
            window.sent(end)
            if room is not None:
                room -= end
            left -= end
            if count and flow_control:
                in_flight.append((window.total_sent, stream.vbucket, last, encoded.arrival, count))
            if end < size:
                parts.append(data[:end])
                if count:
                    stream.sent_part(count, last)
                rest[stream] = _Rest(encoded, end)
                continue
            parts.append(data)
            stream.items_sent += count
            stream.sent_whole(encoded, flow_control)
            markers += encoded.markers
            items += count
            deletions += encoded.deletions
            expirations += encoded.expirations
            if encoded.last >= upto:
                stream.position = upto
                if upto >= end_seqno:
                    self._release(stream)
            else:
                news[stream] = None  # the read stopped at its limit: more next pass
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        conn.conn.send_nowait(data)
        stats = conn.stream_stats
        stats.bytes_sent += len(data)
        stats.unacked_bytes = window.unacked_bytes
        if markers or items:
            count_sent(stats, markers, items, deletions, expirations)
            stats.last_item_time = time.time()
        self.passes += 1


def _cut(stream: LogStream, data: bytes, start: int, room: int | None) -> tuple[int, int, int]:
    """(end, items, last seqno) of what goes from ``start`` within ``room``."""
    if room is None or len(data) - start <= room:
        return stream.fast_encoder().split(data, start, len(data) - start)
    return stream.fast_encoder().split(data, start, room)
