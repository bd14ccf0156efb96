"""A UPR consumer's connection to the gateway: the producer side, served from the log.

Theory of operation. ``UprConnection.run`` takes the connection after its
OPEN (or, in the draft dialect, its first STREAM_REQ or GET_FAILOVER_LOG)
and runs in one nursery:

- the reader (this task): decodes each request and answers it at once:
  CONTROL (connection_buffer_size, enable_noop, set_noop_interval,
  enable_expiry_opcode; unknown keys INVALID_ARGUMENTS), STREAM_REQ (unknown
  or handed-over vbucket NOT_MY_VBUCKET, a bad range RANGE_ERROR, a live
  stream on the vbucket KEY_EXISTS, then the rollback rule against the
  gateway's failover log; on a notifier connection no range checks, and a
  ``LogNotifier`` that ends once the log passes the start),
  GET_FAILOVER_LOG, CLOSE_STREAM, NOOP, and through the front's command door
  what is not UPR (STAT, VERSION, ...); BUFFER_ACKNOWLEDGEMENTs credit the
  flow-control window; replies the streams wait for (SET_VBUCKET_STATE,
  acked markers) go to their stream;
- one ``LogStream`` task per stream, and one ``LiveServer`` task that serves
  the streams caught up with their logs (a pass and a send per publish round);
- the NOOP task once the consumer enabled NOOPs: a NOOP per interval, and
  the connection drops if the previous one is unanswered.

A malformed UPR packet gets INVALID_ARGUMENTS naming what was wrong, then
the connection closes; other consumers are untouched. An opcode that is
neither UPR's nor the door's gets UNKNOWN_COMMAND and the stream goes on.

Stats: the connection's ``StreamStats`` (direction upr_front) counts bytes,
items by kind, the window, time blocked on it, and per vbucket the seqnos
sent and acknowledged. With flow control on, each write's items (their
count, last seqno and first arrival) are kept until the consumer's buffer
acks cover the write, which gives the latency from log arrival to consumer
acknowledgement (bounded by the window; an item counts with the oldest
arrival of its write, so one histogram update per write).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import Status
from adapters.translate.log_records import LogItem
from adapters.translate.log_to_upr_fast import EncodedBatch
from adapters.upr.opening import notifies_only
from adapters.upr.rollback import answer_stream_request, resolve_end
from gateway.fronts.upr.serving import LiveServer
from gateway.fronts.upr.streams import MAX_SEQNO, LogStream
from gateway.fronts.upr.takeover import take_over
from gateway.fronts.upr.vblog import VbLog
from gateway.io.connection import ConnectionClosed, PacketConnection
from gateway.io.upr_producer import UprProducerBase
from gateway.io.upr_stream import NotifierStream
from gateway.metrics.figures import LATENCY_BUCKETS, LatencyHistogram, StreamStats
from gateway.tools.capture.mapping import UprRecording
from gateway.tools.capture.records import Kind

if TYPE_CHECKING:
    from gateway.fronts.upr.server import UprFront

log = logging.getLogger(__name__)

_OK = Status.SUCCESS.value


@dataclass
class Settings:
    delete_times: bool = False
    expiry_opcode: bool = False


def delete_kind(expiry_opcode: bool) -> Kind:
    """How a capture records a DELETION: ``DELETE`` (deletion or expiration, not
    told apart) unless the consumer gets expirations as EXPIRATION."""
    return Kind.DELETION if expiry_opcode else Kind.DELETE


class LogNotifier(NotifierStream):
    """A notifier stream on a vbucket's log: it reads nothing, so no other stream
    waits on it for a shared read (``position``), and it ends STATE_CHANGED as
    the log's streams do when the log is set aside (not when it is handed over:
    ``takeover.py``)."""

    position = MAX_SEQNO

    def __init__(self, conn: UprConnection, vblog: VbLog, req: upr.StreamRequest) -> None:
        super().__init__(req, send=conn.send_counted, beyond=self._beyond)
        self.vblog = vblog

    async def _beyond(self, start: int) -> upr.StreamEndReason:
        await self.vblog.wait_beyond(start)
        return upr.StreamEndReason.OK

    def takeover_stats(self) -> dict[str, str]:
        return {}  # 3.0 ``addTakeoverStats``: active streams only


class UprConnection(UprProducerBase[LogStream | LogNotifier]):
    def __init__(
        self,
        front: UprFront,
        conn: PacketConnection,
        name: str,
        flags: upr.OpenFlags,
        stream_stats: StreamStats,
    ) -> None:
        delete_times = bool(flags & upr.OpenFlags.INCLUDE_DELETE_TIMES)
        super().__init__(
            conn,
            name,
            front.dialect,
            front.config.noop_interval,
            delete_times=delete_times,
            serves=front.serves,
            high_seqno=lambda vb: front.logs.logs[vb].high_seqno,
            notifier=notifies_only(flags),
            answer=front.door.answer,
        )
        self.front = front
        self.draft = upr.Command.SNAPSHOT_MARKER not in self.dialect.opcodes
        self.settings = Settings(delete_times=delete_times)
        self.stream_stats = stream_stats
        self._stat_prefix = f"{name}:"  # STAT dcp adds eq_dcpq: (and eq_uprq:)
        # (window bytes sent when the write ended, vbucket, last seqno in it, arrival
        # of its first item, items in it): one entry per write on the fast path
        self._in_flight: deque[tuple[int, int, int, float, int]] = deque()
        self.streams_waiting = 0
        """Streams blocked for room in the window or the outbox (all of them: stalled)."""
        self.recording: UprRecording | None = None
        """Records what this connection sends (``capture_dir``); set by the front."""
        self.live = LiveServer(self)
        """Serves the streams that caught up with their logs, in one task."""

    def _on_decode_error(self, exc: ProtocolError) -> None:
        kind = "unknown_opcode" if exc.status == Status.UNKNOWN_COMMAND else "malformed"
        self.front.stats.protocol_errors_total[("upr_front", kind)] += 1

    # -- sending ---------------------------------------------------------------

    async def send_counted(self, event: upr.UprRequest) -> None:
        """Send one stream message (not an item), within the flow-control window."""
        if self.recording is not None:
            self.recording.record(event, event.vbucket, time.time())
        await self.send_messages([upr.encode(event, self.dialect)], None, event.vbucket)

    async def send_messages(
        self,
        messages: list[bytes],
        items: list[LogItem | None] | None,
        vbucket: int,
        on_sent: Callable[[int], None] | None = None,
    ) -> None:
        """Send stream messages in order, joined into as few writes as the window allows.

        ``items[i]`` is the logged item ``messages[i]`` carries (None for a
        marker): with flow control on, its arrival is kept until the
        consumer's acks cover the message, for the latency figure.
        ``on_sent(n)`` is told after each write that the first ``n`` are out,
        so a stream held by the window counts what did go.
        """
        window = self.window
        stats = self.stream_stats
        if not window.enabled:
            data = b"".join(messages) if len(messages) > 1 else messages[0]
            await self.conn.send(data)
            stats.bytes_sent += len(data)
            if on_sent is not None:
                on_sent(len(messages))
            return
        start, count = 0, len(messages)
        in_flight = self._in_flight
        while start < count:
            if not window.can_send:
                # The framing of a batch read up to the budget may overshoot the window.
                await self._wait_counted()
            end = start
            # Whole messages while there is room: the last one may overshoot
            # the buffer, as a producer stops only once it is full.
            while end < count and window.can_send:
                window.sent(len(messages[end]))
                item = items[end] if items is not None else None
                if item is not None:
                    in_flight.append((window.total_sent, vbucket, item.by_seqno, item.arrival, 1))
                end += 1
            data = b"".join(messages[start:end])
            await self.conn.send(data)
            stats.bytes_sent += len(data)
            stats.unacked_bytes = window.unacked_bytes
            start = end
            if on_sent is not None:
                on_sent(end)

    async def send_encoded(
        self,
        encoded: EncodedBatch,
        vbucket: int,
        split: Callable[[bytes, int, int], tuple[int, int, int]],
        on_sent: Callable[[int, int], None],
    ) -> None:
        """``send_messages`` for a batch encoded as one buffer (the serving fast path).

        ``split`` (``BatchEncoder.split``) finds the whole messages that fit
        the window's room when the rest of the batch does not. The window,
        the byte counts and the latency entry are updated once per write (each
        write's items counted with the batch's oldest arrival: an upper
        bound); ``on_sent(items, last seqno)`` is told after each write that
        carried items.
        """
        window = self.window
        stats = self.stream_stats
        data = encoded.data
        size = len(data)
        if not window.enabled:
            await self.conn.send(data)
            stats.bytes_sent += size
            on_sent(encoded.items, encoded.last)
            return
        start = first = 0
        while start < size:
            if not window.can_send:
                await self._wait_counted()
            room = window.room  # None: a CONTROL turned flow control off meanwhile
            if room is None or size - start <= room:
                end, count, last = size, encoded.items - first, encoded.last
            else:
                end, count, last = split(data, start, room)
            window.sent(end - start)
            if count:
                self._in_flight.append((window.total_sent, vbucket, last, encoded.arrival, count))
            await self.conn.send(data if end - start == size else data[start:end])
            stats.bytes_sent += end - start
            stats.unacked_bytes = window.unacked_bytes
            start = end
            if count:
                first += count
                on_sent(count, last)

    async def _wait_counted(self) -> None:
        """``_wait_for_room``, counted in ``streams_waiting`` while it waits."""
        self.streams_waiting += 1
        try:
            await self._wait_for_room()
        finally:
            self.streams_waiting -= 1

    def room_now(self) -> int:
        """The least of the outbox's room and the window's (if any) now, without waiting."""
        outbox = self.conn.outbox_room
        room = self.window.room
        return outbox if room is None else min(outbox, room)

    async def send_budget(self, waiting: int = 1) -> int:
        """Bytes of keys and values a stream may read from the log now, once there is room.

        The least of the window's room (flow control) and the outbox's room
        (``max_outbox_bytes``, with or without flow control), so a stalled
        consumer costs its connection at most the outbox plus one batch's
        overshoot, however many streams it has: a stream waits here holding
        nothing, and what it reads it queues without waiting. ``waiting``: the streams
        the caller waits for (the connection's ``LiveServer`` waits for several).
        """
        conn = self.conn
        self.streams_waiting += waiting
        try:
            while True:
                await self._wait_for_room()
                await conn.wait_for_room()
                if not conn.outbox_room:
                    raise ConnectionClosed(conn.name)  # closing: the outbox never drains
                room = self.window.room
                if room is None or room > 0:
                    return self.room_now()
        finally:
            self.streams_waiting -= waiting

    def _on_unblocked(self, seconds: float) -> None:
        self.stream_stats.blocked_seconds += seconds

    # -- requests --------------------------------------------------------------

    async def _stream_request(self, req: upr.StreamRequest) -> None:
        vblog = self.front.logs.logs[req.vbucket]  # served: the machine checked
        req = resolve_end(req, vblog.high_seqno)
        answer = answer_stream_request(
            req,
            vblog.failover.entries,
            vblog.high_seqno,
            purge_seqno=vblog.purge_seqno,
            draft=self.draft,
            notifier=self.machine.notifier,
        )
        if isinstance(answer, upr.StreamRequestRollback):
            self.front.stats.rollbacks_total["upr_front"] += 1
            self.front.stats.last_rollback_seqno["upr_front"] = answer.rollback_seqno
        if not isinstance(answer, upr.StreamRequestOk):
            await self.respond(answer)
            return
        stream: LogStream | LogNotifier
        if self.machine.notifier:
            stream = LogNotifier(self, vblog, req)
        else:
            stream = LogStream(self, vblog, req, partial(take_over, self.front))
        self.machine.add_stream(req.vbucket, stream)
        await self.respond(answer)
        assert self._nursery is not None
        self._nursery.start_soon(stream.run)

    async def _failover_log(self, req: upr.GetFailoverLog) -> None:
        vblog = self.front.logs.get(req.vbucket)
        if vblog is None:
            await self._refuse(req, Status.NOT_MY_VBUCKET, f"no vbucket {req.vbucket} here")
            return
        await self.respond(upr.FailoverLogResponse(vblog.failover.entries, req.opaque))

    def _on_acknowledged(self) -> None:
        self.stream_stats.unacked_bytes = self.window.unacked_bytes
        self._credit(self.window.total_acked)

    def _credit(self, acked: int) -> None:
        """Items whose whole message the acks now cover: acked seqnos and latency."""
        stats = self.stream_stats
        now = time.time()
        in_flight = self._in_flight
        while in_flight and in_flight[0][0] <= acked:
            _, vb, seqno, arrival, count = in_flight.popleft()
            stats.vbucket(vb).acked_seqno = seqno
            _observe(stats.latency, max(0.0, now - arrival), count)

    def _on_buffer_size(self, size: int) -> None:
        self.stream_stats.buffer_size = size

    def _on_expiry_opcode(self, enabled: bool) -> None:
        self.settings.expiry_opcode = enabled
        if self.recording is not None:
            self.recording.delete_kind = delete_kind(enabled)

    # -- statistics ------------------------------------------------------------

    def _stat_counts(self) -> tuple[int, int, int]:
        streams = self.streams.values()
        return (
            sum(s.items_sent for s in streams),
            sum(s.items_remaining() for s in streams),
            self.stream_stats.bytes_sent,
        )

    def _stream_stats(self, prefix: str) -> list[tuple[str, str]]:
        return [pair for vb in sorted(self.streams) for pair in self.streams[vb].stats(prefix)]


def _observe(latency: LatencyHistogram, seconds: float, count: int) -> None:
    """``count`` items acknowledged at once, each counted with the oldest arrival of
    its write (an upper bound: one histogram update per write, not per item)."""
    latency.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += count
    latency.count += count
    latency.sum += seconds * count
