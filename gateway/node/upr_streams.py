"""One UPR producer stream: from a vbucket's store to the consumer, in snapshots.

Theory of operation. ``check_request`` answers a STREAM_REQ from the store's
state in one synchronous step: NOT_MY_VBUCKET for a vbucket the node does not
have or a DEAD one (ACTIVE, REPLICA and PENDING ones stream), then
``adapters.upr.rollback.answer_stream_request`` as the UPR front uses it:
RANGE_ERROR unless start <= end and snap_start <= start <= snap_end, ROLLBACK
by the 3.0 rule of the store's failover log and purge seqno, else OK with that
log. (A live stream on the vbucket, KEY_EXISTS, is the connection's business.)

``ProducerStream.run`` then sends, tagged with the request's opaque:

1. the catch-up ("backfill"): everything from the start to the high seqno
   at that moment, as ONE snapshot with the DISK flag;
2. live items, one MEMORY snapshot per batch read, a batch never crossing a
   checkpoint boundary and flagged CHECKPOINT when it begins one; between
   batches the stream sleeps on the node's change feed;
3. STREAM_END: OK once the end seqno is sent, STATE_CHANGED once the vbucket
   changes state (whichever it had at the request), except by another
   stream's takeover hand-off: 3.0 makes the vbucket dead without telling its
   other streams, which send what it held and then wait (see ``_take_over``). After the consumer's
   CLOSE_STREAM nothing more is sent: the close response is the end
   (``close_by_consumer``).

Reads are bounded (``BATCH`` items) and each message is sent with the
connection's ``send_counted``, which waits for flow-control room and socket
backpressure, so a stream never holds more than one batch. A memory marker
names exactly the seqnos of the first and last items under it; the disk
marker too, unless the backfill spans several batches and items at its end
are overwritten while it runs (their new versions follow in memory
snapshots). The store keeps one version per key, so no key repeats within
a snapshot.

Takeover (flag 0x01): once caught up the stream sends
SET_VBUCKET_STATE(pending) and waits for
its reply, makes the vbucket DEAD (no more writes), sends what arrived
meanwhile under markers with the ACK flag (the takeover-send phase, the only
one whose markers carry it), waits for those acks, sends SET_VBUCKET_STATE(active), waits
for that reply and ends with OK. The draft dialect has no acks: there the
stream does not wait for replies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from adapters import upr
from adapters.mcbp import Status
from adapters.translate.upr_snapshots import item_event
from adapters.upr.constants import StreamState
from adapters.upr.rollback import answer_stream_request, refusal
from adapters.upr.stream_machine import StreamMachine, stats_rows
from gateway.io.upr_stream import StreamTask
from gateway.node.items import Item, VBucketState

if TYPE_CHECKING:
    from gateway.node.upr_producer import ProducerConnection

BATCH = 256
"""Items read from the store at a time: the most a stream holds in memory."""
_COUNT_CHUNK = 4096
MAX_SEQNO = 0xFFFFFFFFFFFFFFFF

SF = upr.SnapshotFlags


@dataclass
class StreamSettings:
    """What a connection's streams send, as negotiated on the connection."""

    delete_times: bool = False
    """OPEN flag INCLUDE_DELETE_TIMES: deletions and expirations carry delete_time."""
    draft: bool = False
    """The transport draft: STREAM_START, SNAPSHOT_START/END, no acks."""
    expiry_opcode: bool = False
    """CONTROL enable_expiry_opcode: expirations travel as EXPIRATION."""


def check_request(
    store: Any, req: upr.StreamRequest, draft: bool, *, notifier: bool = False
) -> upr.StreamRequestOk | upr.StreamRequestRollback | upr.Response:
    """The answer to ``req`` from the store as it is now (``notifier``: a notifier
    connection's request, which has no range checks)."""
    vb = req.vbucket
    if not 0 <= vb < store.n_vbuckets:
        return refusal(req, Status.NOT_MY_VBUCKET, f"no vbucket {vb}")
    if store.state(vb) is VBucketState.DEAD:
        # ep-engine 3.0.0 ``UprProducer::streamRequest`` (hisundar/ep-engine c8c42ea
        # src/upr-producer.cc) checks no state at all, only that the vbucket exists (a
        # dead vbucket would stream what it holds, then nothing, and a takeover
        # of it would hand stale data over as active); much later servers refuse a
        # dead one NOT_MY_VBUCKET (kv_engine engines/ep/src/dcp/producer.cc
        # ``DcpProducer::streamRequest``; the dcp-producer.cc copies up to the 4.x
        # era check no state either), as we do. Replica and pending vbuckets stream, in 3.0.0
        # as after it.
        return refusal(req, Status.NOT_MY_VBUCKET, f"vbucket {vb} is dead")
    # The same answer as the UPR front's, from the store's log, high seqno and
    # purge seqno (ep-engine 3.0 FailoverTable::needsRollback).
    return answer_stream_request(
        req,
        store.failover_log(vb),
        store.high_seqno(vb),
        purge_seqno=store.purge_seqno(vb),
        draft=draft,
        notifier=notifier,
    )


def count_items(store: Any, vb: int, after: int, upto: int) -> int:
    """Items present with ``after < by_seqno <= upto``, read in bounded chunks."""
    total = 0
    while after < upto:
        chunk = store.items_since(vb, after, upto, _COUNT_CHUNK)
        total += len(chunk)
        if len(chunk) < _COUNT_CHUNK:
            break
        after = chunk[-1].by_seqno
    return total


class ProducerStream(StreamTask):
    def __init__(self, producer: ProducerConnection, req: upr.StreamRequest) -> None:
        self.producer = producer
        self.store = producer.node.store
        self.changes = producer.node.changes
        self.settings = producer.settings
        # Everything is "on disk" here: LATEST and DISK_ONLY end at the high seqno now.
        super().__init__(
            StreamMachine(req, self.store.high_seqno(req.vbucket), self.settings.draft)
        )
        self.vbucket = req.vbucket
        self.opaque = req.opaque
        self.flags = req.flags
        self.start_seqno = req.start_seqno
        self.end_seqno = self.rules.end_seqno
        self.snapshot = (req.snap_start_seqno, req.snap_end_seqno)
        self.uuid = req.vbucket_uuid
        self.takeover = self.rules.takeover
        self.last_read = self.last_sent = req.start_seqno
        self.backfill_end = 0
        self.items_sent = 0
        self.markers_sent = 0
        self._state_changes = self.store.state_changes(req.vbucket)
        """The vbucket's state changes told to streams at the request: another ends it."""

    # -- life cycle --------------------------------------------------------------

    async def run(self) -> None:
        reason = upr.StreamEndReason.OK
        with self.scope:
            reason = await self._stream()
        end = self.rules.finish(reason, self.scope.cancelled_caught)
        if end is not None:
            await self.producer.send_counted(end)

    async def _stream(self) -> upr.StreamEndReason:
        if self.settings.draft:
            await self._send(upr.StreamStart(opaque=self.opaque, vbucket=self.vbucket))
        reason = await self._backfill()
        if reason is not None:
            return reason
        self.rules.move(StreamState.IN_MEMORY)
        while True:
            if self.last_read >= self.end_seqno:
                return upr.StreamEndReason.OK
            reason = self._state_changed()
            if reason is not None:
                return reason
            if await self._memory_snapshot():
                continue
            if self.takeover:
                await self._take_over()
                return upr.StreamEndReason.OK
            # Caught up, and nothing awaited since the read: no change can be missed.
            await self.changes.wait(self.vbucket)

    def _state_changed(self) -> upr.StreamEndReason | None:
        if self.store.state_changes(self.vbucket) != self._state_changes:
            # ep-engine 3.0 src/ep.cc ``setVBucketState`` ends every stream of
            # the vbucket on a change it is told to notify (``vbucketStateChanged``
            # -> src/upr-producer.cc ``UprProducer::vbucketStateChanged`` -> ``setDead``).
            return upr.StreamEndReason.STATE_CHANGED
        if self.store.high_seqno(self.vbucket) < self.last_read:
            # Rolled back under the stream: what was sent is no longer history.
            # (3.0 consumers know no ROLLBACK reason; they re-request either way.)
            return upr.StreamEndReason.STATE_CHANGED
        return None

    # -- snapshots ---------------------------------------------------------------

    async def _backfill(self) -> upr.StreamEndReason | None:
        """Start .. high seqno as one DISK snapshot, read in bounded batches."""
        high = min(self.store.high_seqno(self.vbucket), self.end_seqno)
        if self.last_read >= high:
            return None
        self.rules.move(StreamState.BACKFILLING)
        self.backfill_end = high
        batch = self.store.items_since(self.vbucket, self.last_read, high, BATCH)
        if batch:
            # One batch is all of it: the marker can name the exact last seqno.
            last = batch[-1].by_seqno if len(batch) < BATCH else high
            await self._marker(batch[0].by_seqno, last, SF.DISK)
            while batch:
                await self._send_items(batch)
                if len(batch) < BATCH:
                    break
                reason = self._state_changed()
                if reason is not None:
                    return reason
                batch = self.store.items_since(self.vbucket, self.last_read, high, BATCH)
            await self._snapshot_end()
        self.last_read = max(self.last_read, high)
        return None

    async def _memory_snapshot(self) -> bool:
        """Send the next batch of live items as a snapshot; False if caught up."""
        vb = self.vbucket
        high = self.store.high_seqno(vb)
        if self.last_read >= high:
            return False
        first = self.last_read + 1
        checkpoint = self.store.checkpoint_of(vb, first)
        if checkpoint is None:
            # Older than the checkpoints kept: 3.0 would backfill it from disk.
            upper, flags = high, SF.DISK
        else:
            upper = high if checkpoint.open else min(checkpoint.end_seqno, high)
            flags = SF.MEMORY | (SF.CHECKPOINT if checkpoint.start_seqno == first else SF(0))
        upper = min(upper, self.end_seqno)
        flags |= self.rules.ack_flag  # only what is sent once the vbucket is dead here
        batch = self.store.items_since(vb, self.last_read, upper, BATCH)
        if batch:
            await self._marker(batch[0].by_seqno, batch[-1].by_seqno, flags)
            await self._send_items(batch)
            await self._snapshot_end()
        else:
            await trio.lowlevel.checkpoint()  # a range of overwritten items: skip it
        if len(batch) < BATCH:
            self.last_read = max(self.last_read, upper)
        return True

    async def _marker(self, start: int, end: int, flags: upr.SnapshotFlags) -> None:
        await self._send(self.rules.marker(start, end, flags))
        self.markers_sent += 1

    async def _snapshot_end(self) -> None:
        end = self.rules.snapshot_end()
        if end is not None:
            await self._send(end)

    async def _send_items(self, batch: list[Item]) -> None:
        opaque, vb, settings = self.opaque, self.vbucket, self.settings
        expiry, times = settings.expiry_opcode, settings.delete_times
        for item in batch:
            event = item_event(item, opaque, vb, expiry_opcode=expiry, delete_times=times)
            await self.producer.send_counted(event)
            self.last_read = self.last_sent = item.by_seqno
            self.items_sent += 1

    async def _send(self, event: upr.UprRequest) -> None:
        await self.producer.send_counted(event)

    # -- takeover ------------------------------------------------------------------

    async def _take_over(self) -> None:
        await self.wait_for_marker_acks()
        await self._set_vbucket_state(VBucketState.PENDING)
        # 3.0 src/upr-stream.cc ``setVBucketStateAckRecieved``: dead with
        # ``notify_upr`` false, so no stream of the vbucket ends, this one or
        # another connection's: those send what it held, then nothing more comes.
        self.store.set_state(self.vbucket, VBucketState.DEAD, now=time.time(), notify_streams=False)
        self.rules.state_confirmed()
        while await self._memory_snapshot():
            pass  # what was written before the vbucket died
        await self.wait_for_marker_acks()
        await self._set_vbucket_state(VBucketState.ACTIVE)

    async def _set_vbucket_state(self, state: VBucketState) -> None:
        await self._send(self.state_request(state))
        await self.wait_for_state_reply()

    # -- statistics ------------------------------------------------------------------

    def items_remaining(self) -> int:
        if self.state is StreamState.DEAD:
            return 0
        upto = min(self.store.high_seqno(self.vbucket), self.end_seqno)
        return count_items(self.store, self.vbucket, self.last_read, upto)

    def backfill_remaining(self) -> int:
        if self.state is not StreamState.BACKFILLING:
            return 0
        return count_items(self.store, self.vbucket, self.last_read, self.backfill_end)

    def stats(self) -> list[tuple[str, str]]:
        values: list[tuple[str, object]] = [
            ("state", self.state.value),
            ("opaque", self.opaque),
            ("flags", f"0x{int(self.flags):x}"),
            ("start_seqno", self.start_seqno),
            ("end_seqno", self.end_seqno),
            ("vb_uuid", self.uuid),
            ("snap_start_seqno", self.snapshot[0]),
            ("snap_end_seqno", self.snapshot[1]),
            ("last_sent_seqno", self.last_sent),
            ("last_read_seqno", self.last_read),
            ("items_sent", self.items_sent),
            ("items_remaining", self.items_remaining()),
            ("backfill_remaining", self.backfill_remaining()),
            ("markers_sent", self.markers_sent),
            ("unacked_markers", self.rules.unacked_markers),
        ]
        return stats_rows("", self.rules, values)

    def takeover_stats(self) -> dict[str, str]:
        items = self.store.vbucket_stats(self.vbucket).items
        remaining = self.items_remaining()
        return self.rules.takeover_stats(
            self.producer.name, remaining, self.backfill_remaining(), items
        )
