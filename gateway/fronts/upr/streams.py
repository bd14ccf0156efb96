"""One UPR stream served from the durable log.

Theory of operation. After the connection accepted a STREAM_REQ (range
checks and rollback in ``adapters.upr.rollback``), ``LogStream.run`` reads
the vbucket's log in bounded batches from the requested start and sends
them, tagged with the request's opaque:

- each batch is cut into snapshots (``cut_snapshots``): DISK for what came
  in a TAP backfill, MEMORY for live items, CHECKPOINT on a snapshot that
  begins a TAP checkpoint; each marker brackets exactly the items under it;
- once caught up, the stream sleeps until the log publishes more; on the
  fast path (released dialect, no takeover, no capture) it hands itself to
  its connection's ``LiveServer`` (``gateway.fronts.upr.serving``), which
  serves every caught-up stream of the connection in one pass and one send
  per publish round, and gives it back when it falls behind the in-memory
  tail or reaches its end seqno;
- it ends with STREAM_END: OK once everything up to the end seqno is sent
  (items beyond it are never sent), STATE_CHANGED when its log is set
  aside (a takeover by another stream leaves it open: ``takeover.py``);
  after the consumer's CLOSE_STREAM nothing more is sent, the close
  response is the end.

Before each read the stream waits for the connection's ``send_budget``:
room in the flow-control window and in the socket's outbox. It reads at
most that many bytes of keys and values, frames them at once
(``log_to_upr_fast``; a disk read frames them from the log's bytes) and
queues them without waiting; so a stream holds nothing while the
consumer stalls, a connection's memory stays within its outbox limit plus
one batch's framing, and a slow consumer stalls only its own connection.
Without flow control the sent seqno is also the acknowledged one. A stream
that keeps up reads the log's in-memory tail; one behind it reads the disk
(``_next``), sized before the hand-off from the room the connection's other
disk reads have not taken: a worker thread reads the bytes and the loop
frames them a chunk at a time, so a disk read neither blocks the loop on
I/O nor stalls it for long, and keeps the connection's outbox bound. The
streams of all connections take turns (``DISK_TURNS`` at once) to read and
frame from disk, so a round of trio's scheduler holds a few of those slices,
not one per backfilling stream.

Takeover (flag 0x01): markers carry ACK in the takeover-send phase only
(after the consumer took SET_VBUCKET_STATE(pending)); once caught up the
stream asks the takeover coordinator to take the vbucket over from the TAP node; the TAP
node's VBUCKET_SET(pending) and (active) come back here as
``set_state`` calls, which send SET_VBUCKET_STATE and wait for the
consumer's reply before the TAP message is acked. After the active state is
confirmed the stream ends with OK.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import trio

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.mcbp.constants import VBucketState
from adapters.translate.log_records import ItemKind, LogItem
from adapters.translate.log_to_upr_fast import BatchCut, BatchEncoder, EncodedBatch
from adapters.translate.upr_snapshots import ItemEncoder, cut_snapshots
from adapters.upr.constants import StreamState
from adapters.upr.stream_machine import StreamMachine, stats_rows
from gateway.fronts.upr.damage import set_aside_damaged
from gateway.fronts.upr.segments import LogReadError, Segment
from gateway.fronts.upr.shared_reads import TAIL, Key, Shared, shared_reads
from gateway.fronts.upr.vblog import VbLog
from gateway.io.upr_stream import StreamTask

if TYPE_CHECKING:
    from gateway.fronts.upr.producer import UprConnection
    from gateway.metrics.figures import StreamStats

BATCH = 1024
BATCH_BYTES = 1024 * 1024
"""A stream reads at most this many items, and about this many bytes of keys
and values, per batch (what one stream holds in memory)."""
DISK_BATCH = 512
"""Items of a disk read before it stops at the end of the block at hand: what
the loop frames between two waits stays under about a millisecond."""
MAX_SEQNO = 0xFFFFFFFFFFFFFFFF
SF = upr.SnapshotFlags
_KIND_NAMES = {ItemKind.MUTATION: "mutation", ItemKind.DELETION: "deletion",
               ItemKind.EXPIRATION: "expiration"}  # fmt: skip


class DiskReads:
    """Bytes the disk reads of one connection's streams in flight may yet queue."""

    def __init__(self) -> None:
        self.taken = 0
        self._returned = trio.Event()

    async def returned(self) -> None:
        """Until one of those reads returns."""
        await self._returned.wait()

    def wake(self) -> None:
        self._returned.set()
        self._returned = trio.Event()


_disk_reads: WeakKeyDictionary[object, DiskReads] = WeakKeyDictionary()

DISK_TURNS = 8
"""Streams framing a disk read at once, for every connection of the process.
Trio runs one step of every ready task before it looks at the sockets and
timers again: with each of 10 consumers' 64 streams reading its backfill
every stream was ready, and one round of ~1 ms steps held the loop for
0.4 s of CPU (seconds on a loaded machine), so every other connection
(a live consumer, the TAP upstream, a STAT) waited as long. Turns are
handed out in arrival order, so streams share the loop fairly still."""
_disk_turns: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("disk_turns")


def disk_turns() -> trio.CapacityLimiter:
    try:
        return _disk_turns.get()
    except LookupError:
        limiter = trio.CapacityLimiter(DISK_TURNS)
        _disk_turns.set(limiter)
        return limiter


def disk_reads(conn: object) -> DiskReads:
    reads = _disk_reads.get(conn)
    if reads is None:
        reads = _disk_reads[conn] = DiskReads()
    return reads


def count_sent(
    stats: StreamStats, markers: int, items: int, deletions: int, expirations: int
) -> None:
    """The connection's counts by kind of what went (once per batch, or per pass)."""
    counts = stats.items_sent
    counts["marker"] += markers
    if items - deletions - expirations:
        counts["mutation"] += items - deletions - expirations
    if deletions:
        counts["deletion"] += deletions
    if expirations:
        counts["expiration"] += expirations


TakeOver = Callable[["LogStream"], Awaitable[upr.StreamEndReason]]
"""Hands a caught-up takeover stream's vbucket over (``takeover.take_over``, bound
to the front): passed down, so a stream never calls up into the front."""


class LogStream(StreamTask):
    def __init__(
        self,
        conn: UprConnection,
        vblog: VbLog,
        req: upr.StreamRequest,
        take_over: TakeOver | None = None,
    ) -> None:
        self.conn = conn
        self._take_over = take_over
        self.vblog = vblog
        super().__init__(StreamMachine(req, vblog.high_seqno, conn.draft, StreamState.BACKFILLING))
        self.vbucket = req.vbucket
        self.opaque = req.opaque
        self.start_seqno = req.start_seqno
        self.end_seqno = self.rules.end_seqno
        self.takeover = self.rules.takeover
        self.position = req.start_seqno
        self.items_sent = 0
        self.markers_sent = 0
        self.peak_batch_bytes = 0
        """Wire bytes of the largest batch read and sent at once (what the stream held)."""
        self._encoder_key: tuple[bool, bool] | None = None
        self._item_encoder: ItemEncoder | None = None
        self._batch_encoder: BatchEncoder | None = None
        self._resume: tuple[int, Segment, int] | None = None
        """(seqno, segment, offset): where the disk read after that seqno may start."""
        self.progress = conn.stream_stats.vbucket(self.vbucket)
        self.progress.upstream_high_seqno = vblog.high_seqno
        self.progress.sent_seqno = self.progress.acked_seqno = req.start_seqno

    # -- life cycle ------------------------------------------------------------

    async def run(self) -> None:
        reason = upr.StreamEndReason.OK
        with self.scope:
            try:
                reason = await self._stream()
            except LogReadError as exc:
                # Set aside and fetched again; the stream ends as its vbucket changed.
                await set_aside_damaged(self.conn.front, self.vblog, exc)
                reason = upr.StreamEndReason.STATE_CHANGED
        end = self.rules.finish(reason, self.scope.cancelled_caught)
        if end is not None:  # else the CLOSE_STREAM response was the end
            await self.conn.send_counted(end)
        stats = self.conn.front.stats
        reason = self.rules.end_reason or reason
        stats.stream_ends_total[("upr_front", reason.name.lower())] += 1

    async def _stream(self) -> upr.StreamEndReason:
        if self.conn.draft:
            await self.conn.send_counted(upr.StreamStart(opaque=self.opaque, vbucket=self.vbucket))
        vblog = self.vblog
        while True:
            if self.position >= self.end_seqno:
                return upr.StreamEndReason.OK
            # One yield per batch, before the room is measured: a read the page
            # cache serves at once then takes it and sends with no wait between.
            await trio.lowlevel.checkpoint()
            budget = await self.conn.send_budget()
            high = vblog.high_seqno
            self.progress.upstream_high_seqno = high
            upto = min(high, self.end_seqno)
            last = await self._next(upto, budget)
            if last is None:
                continue  # the room went to the connection's disk reads: ask again
            if last >= upto or not last:
                self.position = max(self.position, upto)  # the rest were gaps
                if self.position >= self.end_seqno:
                    return upr.StreamEndReason.OK
                self.rules.move(StreamState.IN_MEMORY)
                self.progress.backfilling = False
                if self.takeover:
                    if self._take_over is None:
                        raise AssertionError("a takeover stream without a hand-off")
                    return await self._take_over(self)
                if self.conn.draft or self.conn.recording is not None:
                    await vblog.wait_beyond(self.position)  # the event path, from here
                else:
                    await self.conn.live.follow(self)  # until it needs this task again

    async def _next(self, upto: int, budget: int) -> int | None:
        """Read and send the next batch up to ``upto``, of at most ``budget`` bytes less
        what the connection's disk reads in flight have taken: the seqno of its last
        item (0: none, the rest up to ``upto`` are gaps), or None when those reads
        took all the room.

        Live streams read the in-memory tail, at once; a stream behind it reads
        the disk (``VbLog.read_disk``: the bytes in a worker thread, decoded on
        the loop a chunk at a time), its size taken from the connection's room
        before the hand-off, so the other streams of the connection cannot
        claim the same room meanwhile (the outbox limit still bounds what a
        stalled consumer costs). On the fast path (``log_to_upr_fast``) a disk
        read frames the items straight from the log's block bytes.
        """
        vblog = self.vblog
        conn = self.conn
        reads = disk_reads(conn)
        asked = min(BATCH_BYTES, budget) - reads.taken
        if asked <= 0:
            await reads.returned()
            return None
        extra = self.rules.ack_flag  # only once the vbucket is being handed over
        fast = not conn.draft and not extra and conn.recording is None
        # A disk read waits for its turn before ``segments_settled``: no checkpoint
        # may come between that and the read. The turn is given back before the
        # send, which may wait for a slow consumer.
        turn = None if vblog.in_memory(self.position) else disk_turns()
        claim: Key | None = None
        if turn is not None and fast:
            # The same batch framed for another stream, or being read for one now.
            found = await self._shared(upto, asked)
            if not isinstance(found, tuple):
                return found
            asked, claim = found
        try:
            if turn is not None:
                await turn.acquire_on_behalf_of(self)
                # The room measured before the wait may have gone to other streams.
                asked = min(asked, self.conn.room_now() - reads.taken)
                if asked <= 0:
                    return None
            return await self._read_and_send(upto, asked, extra, fast, turn)
        finally:
            self._give_back(turn)
            if claim is not None:
                shared_reads().end(claim)

    async def _shared(self, upto: int, asked: int) -> int | tuple[int, Key | None] | None:
        """A disk batch another stream framed (``shared_reads``): sent, its last seqno;
        None when the room went meanwhile; else (room, the key this stream now reads
        for the others, if any)."""
        shared = shared_reads()
        vblog = self.vblog
        while True:
            found = shared.key(vblog, self.position, upto, DISK_BATCH, self.conn.dialect,
                               self.fast_encoder())  # fmt: skip
            if found is None:
                return asked, None
            key, segment = found
            batch = shared.take(key, vblog, segment, asked, self.opaque)
            if batch is not None:
                return await self._send_shared(batch)
            reading = shared.reading(key)
            if reading is None:
                shared.begin(key)
                return asked, key
            await reading.wait()
            asked = min(asked, self.conn.room_now() - disk_reads(self.conn).taken)
            if asked <= 0:
                return None

    def _tail_batch(self, upto: int, asked: int) -> EncodedBatch:
        """The next batch of the in-memory tail, framed here or by a stream at the same place."""
        shared = shared_reads()
        encoder = self.fast_encoder()
        key = shared.tail_key(self.vblog, self.position, upto, BATCH, self.conn.dialect, encoder)
        found = shared.take(key, self.vblog, TAIL, asked, self.opaque)
        if found is not None:
            return found.encoded
        cut = BatchCut(encoder, self.position, upto, BATCH, asked)
        self.vblog.read_memory(self.position, upto, cut)
        encoded = cut.finish()
        shared.put(key, self.vblog, TAIL, encoded, self.opaque, None, True, asked, cut.left,
                   self._behind())  # fmt: skip
        return encoded

    def _behind(self) -> int:
        """Other live streams of this log not past this one: who may want its batch."""
        count = 0
        for connection in self.conn.front.connections.values():
            other = connection.streams.get(self.vbucket)
            if (
                other is not None
                and other is not self
                and other.vblog is self.vblog
                and other.live
                and other.position <= self.position
            ):
                count += 1
        return count

    async def _send_shared(self, batch: Shared) -> int:
        encoded = batch.encoded
        whole = batch.stop is not None and batch.whole and encoded.items
        self._resume = (encoded.last, *batch.stop) if whole and batch.stop is not None else None
        if encoded.items:
            await self._send_encoded(encoded)
        return encoded.last

    def _give_back(self, turn: trio.CapacityLimiter | None) -> None:
        if turn is not None and self in turn.statistics().borrowers:
            turn.release_on_behalf_of(self)

    async def _read_and_send(
        self,
        upto: int,
        asked: int,
        extra: upr.SnapshotFlags,
        fast: bool,
        turn: trio.CapacityLimiter | None,
    ) -> int | None:
        vblog = self.vblog
        reads = disk_reads(self.conn)
        await vblog.segments_settled()  # no checkpoint between it and the read
        if vblog.in_memory(self.position):
            if fast:  # framed from the tail's record bytes, as from the disk's
                encoded = self._tail_batch(upto, asked)
                self._give_back(turn)
                if not encoded.items:
                    return 0
                await self._send_encoded(encoded)
                return encoded.last
            batch = vblog.read(self.position, upto, BATCH, asked)
            self._give_back(turn)
            if not batch:
                return 0
            await self._send_batch(batch, extra)
            return batch[-1].by_seqno
        reads.taken += asked
        try:
            if fast:
                cut = BatchCut(self.fast_encoder(), self.position, min(upto, vblog.high_seqno),
                               DISK_BATCH, asked)  # fmt: skip
                resume = self._resume
                start = resume[1:] if resume is not None and resume[0] == self.position else None
                shared = shared_reads()
                found = shared.key(vblog, self.position, upto, DISK_BATCH, self.conn.dialect,
                                   cut.encoder)  # fmt: skip
                stop = await vblog.read_disk(self.position, upto, cut, resume=start)
                encoded = cut.finish()
                if found is not None:  # for the streams that want the same batch
                    shared.put(found[0], vblog, found[1], encoded, self.opaque, stop,
                               cut.whole, asked, cut.left, self._behind())  # fmt: skip
                # Where the next read may start, once this batch went out.
                whole = stop is not None and cut.whole and encoded.items
                self._resume = (encoded.last, *stop) if whole and stop is not None else None
            else:
                batch = await vblog.read_async(self.position, upto, DISK_BATCH, asked)
        finally:
            reads.taken -= asked
            reads.wake()
        self._give_back(turn)
        if fast:
            if encoded.items:
                await self._send_encoded(encoded)
            return encoded.last
        if not batch:
            return 0
        await self._send_batch(batch, extra)
        return batch[-1].by_seqno

    def _encoder(self) -> ItemEncoder:
        settings = self.conn.settings
        key = (settings.expiry_opcode, settings.delete_times)
        if self._encoder_key != key:  # CONTROL may change them mid-stream
            self._encoder_key = key
            self._item_encoder = ItemEncoder(
                self.conn.dialect,
                self.opaque,
                self.vbucket,
                expiry_opcode=key[0],
                delete_times=key[1],
            )
        assert self._item_encoder is not None
        return self._item_encoder

    def fast_encoder(self) -> BatchEncoder:
        encoder = self._batch_encoder
        settings = self.conn.settings
        if (
            encoder is None
            or encoder.delete_times != settings.delete_times
            or encoder.expiry_opcode != settings.expiry_opcode
        ):
            encoder = self._batch_encoder = BatchEncoder(
                self.conn.dialect,
                self.opaque,
                self.vbucket,
                expiry_opcode=settings.expiry_opcode,
                delete_times=settings.delete_times,
            )
        return encoder

    async def _send_batch(self, batch: list[LogItem], extra: upr.SnapshotFlags) -> None:
        """Markers and items of one batch, encoded at once and sent joined (the event
        path: the draft dialect, a takeover's send phase, a capture)."""
        conn = self.conn
        encode = self._encoder().encode
        messages: list[bytes] = []
        items: list[LogItem | None] = []
        kinds = [0, 0, 0]
        markers = 0
        for snap in cut_snapshots(batch, extra=extra):
            messages.append(self._marker(snap.start, snap.end, snap.flags))
            items.append(None)
            markers += 1
            for item in snap.items:
                messages.append(encode(item))
                items.append(item)
                kinds[item.kind] += 1
            end = self.rules.snapshot_end()
            if end is not None:
                messages.append(self._encode(end))
                items.append(None)
        if conn.recording is not None:
            self._record(messages, items)
        size = sum(map(len, messages))
        if size > self.peak_batch_bytes:
            self.peak_batch_bytes = size
        done = 0

        def sent(upto: int) -> None:
            # Per write, not per batch: the window may hold the rest back, and
            # items_sent / last_sent_seqno / items_remaining tell what went.
            nonlocal done
            for item in items[done:upto]:
                if item is not None:
                    self.items_sent += 1
                    self.position = self.progress.sent_seqno = item.by_seqno
            done = upto

        await conn.send_messages(messages, items, self.vbucket, sent)
        self.position = batch[-1].by_seqno
        self.markers_sent += markers
        counts = conn.stream_stats.items_sent
        counts["marker"] += markers
        for kind, count in zip(ItemKind, kinds, strict=True):
            if count:
                counts[_KIND_NAMES[kind]] += count
        progress = self.progress
        progress.sent_seqno = self.position
        if not conn.window.enabled:
            # Without flow control nothing is acknowledged: sent is as far as it goes.
            progress.acked_seqno = self.position
        conn.stream_stats.last_item_time = time.time()

    async def _send_encoded(self, encoded: EncodedBatch) -> None:
        """A batch framed in one pass (``log_to_upr_fast``): the bytes of ``_send_batch``,
        and the counters and window accounting once per write instead of per message."""
        conn = self.conn
        if len(encoded.data) > self.peak_batch_bytes:
            self.peak_batch_bytes = len(encoded.data)
        await conn.send_encoded(encoded, self.vbucket, self.fast_encoder().split, self.sent_part)
        self.sent_whole(encoded, conn.window.enabled)
        count_sent(conn.stream_stats, encoded.markers, encoded.items, encoded.deletions,
                   encoded.expirations)  # fmt: skip
        conn.stream_stats.last_item_time = time.time()

    def sent_part(self, count: int, last: int) -> None:
        """``count`` items of a batch went, up to seqno ``last`` (per write: the window
        may hold the rest back)."""
        self.items_sent += count
        self.position = self.progress.sent_seqno = last

    def sent_whole(self, encoded: EncodedBatch, flow_control: bool) -> None:
        """The whole of a framed batch went (its items counted by ``sent_part``): where
        the stream is (the connection's counts are ``count_sent``'s)."""
        progress = self.progress
        self.position = progress.sent_seqno = encoded.last
        self.markers_sent += encoded.markers
        if not flow_control:
            # Without flow control nothing is acknowledged: sent is as far as it goes.
            progress.acked_seqno = self.position

    def _encode(self, event: upr.UprRequest) -> bytes:
        return upr.encode(event, self.conn.dialect)

    def _marker(self, start: int, end: int, flags: upr.SnapshotFlags) -> bytes:
        return self._encode(self.rules.marker(start, end, flags))

    def _record(self, messages: list[bytes], items: list[LogItem | None]) -> None:
        """Capture what this batch sends (only with ``capture_dir``: decodes each message)."""
        recording = self.conn.recording
        assert recording is not None
        now = time.time()
        reader = FrameReader()
        for data in messages:
            reader.receive_data(data)
        for frame in reader.frames():
            recording.record(upr.decode_frame(frame, self.conn.dialect), self.vbucket, now)

    # -- takeover --------------------------------------------------------------

    async def catch_up(self) -> None:
        """Send whatever the log holds beyond the position (takeover, before each state)."""
        while self.position < min(self.vblog.high_seqno, self.end_seqno):
            await trio.lowlevel.checkpoint()  # as in ``_stream``
            budget = await self.conn.send_budget()
            upto = min(self.vblog.high_seqno, self.end_seqno)
            last = await self._next(upto, budget)
            if last is not None and (last >= upto or not last):
                self.position = max(self.position, upto)
        await self.wait_for_marker_acks()

    async def set_state(self, state: VBucketState) -> None:
        """SET_VBUCKET_STATE to the consumer; returns once it replied."""
        await self.catch_up()
        await self.conn.send_counted(self.state_request(state))
        self.conn.stream_stats.items_sent["state"] += 1
        await self.wait_for_state_reply()
        self.rules.state_confirmed()

    # -- statistics ------------------------------------------------------------

    def items_remaining(self) -> int:
        if not self.live:
            return 0
        return max(0, min(self.vblog.high_seqno, self.end_seqno) - self.position)

    def stats(self, prefix: str) -> list[tuple[str, str]]:
        values: list[tuple[str, object]] = [
            ("opaque", self.opaque),
            ("state", self.state.value),
            ("start_seqno", self.start_seqno),
            ("end_seqno", self.end_seqno),
            ("last_sent_seqno", self.position),
            ("items_sent", self.items_sent),
            ("items_remaining", self.items_remaining()),
            ("markers_sent", self.markers_sent),
            ("takeover", str(self.takeover).lower()),
        ]
        return stats_rows(prefix, self.rules, values)

    def takeover_stats(self) -> dict[str, str]:
        remaining = self.items_remaining()
        return self.rules.takeover_stats(self.conn.name, remaining, 0,
                                         self.vblog.translator.live_keys)  # fmt: skip
