"""One vbucket of a UPR stream, served as TAP (the TAP front's translation).

Theory of operation. UPR groups items into snapshots; TAP into checkpoints
and, for a backfill, an initial vbucket stream. ``UprToTap`` turns each
event of one vbucket's UPR stream into the TAP messages a 2.x server would
have sent (unstamped: the TAP producer adds sequence numbers and ack flags):

- the first snapshot of a stream that backfills from zero becomes
  OPAQUE(INITIAL_VBUCKET_STREAM), its items, OPAQUE(CLOSE_BACKFILL): a DISK
  snapshot usually, a MEMORY one when the producer still holds every item
  in memory (a 2.x server backfilled a new client all the same, and its
  receiver resets the vbucket on the first message);
- with ``checkpoint_sync`` (the client set the CHECKPOINT connect flag),
  every other snapshot becomes CHECKPOINT_START(id), its items,
  CHECKPOINT_END(id), with ids increasing per vbucket (drawn from
  ``checkpoint_ids``, which a caller may share between streams);
  ``checkpoints`` keeps id -> (first, last) seqno actually sent under that
  checkpoint, recorded when it closes, so a client that resumes by
  checkpoint id can be resumed by seqno upstream. Without it the items come
  alone, as 2.x sent them (ep-engine 2.5.1 src/tapconnection.cc queues
  checkpoint messages only when ``supportCheckpointSync_``, which
  ``TapProducer::evaluateFlags`` sets for the CHECKPOINT flag alone): the
  snapshot is still tracked (checkpoint id 0, ``NO_CHECKPOINT``), but no id
  is drawn nor remembered;
- after ``resume()`` (the upstream stream was re-requested from the last
  seqno sent), the first marker continues the snapshot still open instead of
  closing it: the client sees one unbroken checkpoint or backfill;
- a snapshot closes at the item whose by_seqno is its end, or, when
  deduplication or purged tombstones leave it short, at the next marker or
  at the end of the stream;
- mutations become MUTATION, deletions and expirations DELETE, built by
  ``adapters.tap.item_messages`` as every TAP producer here builds them;
- SET_VBUCKET_STATE becomes VBUCKET_SET (a "replica" read as pending, see
  ``_in_stream``).

Anything else in a vbucket's stream is a protocol error naming it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from adapters.errors import ProtocolError
from adapters.fastinit import positional_constructor
from adapters.mcbp.constants import VBucketState
from adapters.tap.constants import OpaqueCode
from adapters.tap.events import (
    TapCheckpointEnd,
    TapCheckpointStart,
    TapOpaque,
    TapStreamMessage,
    TapVbucketSet,
)
from adapters.tap.item_messages import ItemMessages
from adapters.upr.events import (
    Deletion,
    Expiration,
    Mutation,
    SetVbucketState,
    SnapshotMarker,
    StreamEnd,
    UprEvent,
)

MAX_REMEMBERED_CHECKPOINTS = 64
"""As many as the TAP front's registry keeps per vbucket (an older id means a
backfill there). Each entry is an object the garbage collector tracks: at 1,024
per vbucket a live stream of one-item snapshots added some 65,000 before the
oldest went, enough for a young collection of 10 ms or more early in every session."""


NO_CHECKPOINT = 0
"""The checkpoint id of a snapshot sent without checkpoint messages (no CHECKPOINT
flag); real ids start at 1."""


@dataclass(frozen=True, slots=True)
class OpenSnapshot:
    start: int
    end: int
    checkpoint_id: int | None
    """None for the backfill (initial vbucket stream), ``NO_CHECKPOINT`` for a
    snapshot sent without checkpoint messages, else the TAP checkpoint id."""


def _snapshot_constructor() -> Callable[[int, int, int | None], OpenSnapshot]:
    """``OpenSnapshot`` for the fast path, which opens one per one-item snapshot: the
    positional constructor in Python; compiled (``scripts/build-mypyc``), the class's
    own, which is the fast one there and the only one it accepts."""
    make = positional_constructor(OpenSnapshot)
    try:
        make(0, 0, None)
    except TypeError:
        return OpenSnapshot
    return make


_open_snapshot = _snapshot_constructor()


class UprToTap:
    """Translator for one vbucket's stream; feed events, get TAP messages."""

    def __init__(
        self,
        vbucket: int,
        *,
        backfill: bool,
        keys_only: bool = False,
        network_byte_order: bool = False,
        first_checkpoint_id: int = 1,
        checkpoint_ids: Iterator[int] | None = None,
        continue_backfill: bool = False,
        checkpoint_sync: bool = False,
    ) -> None:
        """``continue_backfill``: the client already holds the start of this
        vbucket's backfill; go on with it (no new INITIAL_VBUCKET_STREAM).
        ``checkpoint_sync``: the client set the CHECKPOINT flag, so snapshots
        become checkpoints (see the module docstring)."""
        self.vbucket = vbucket
        self.checkpoint_sync = checkpoint_sync
        self.keys_only = keys_only
        self.network_byte_order = network_byte_order
        self._expect_backfill = backfill
        self._ids = checkpoint_ids or itertools.count(first_checkpoint_id)
        self.open: OpenSnapshot | None = None
        self.last_seqno = 0
        self.first_in_open = 0
        self.snap_start = self.snap_end = 0
        """The range of the latest snapshot marker (whatever it opened or continued)."""
        self.items_in_snap = 0
        """Items taken since that marker."""
        self._resuming = False
        if continue_backfill:
            self.open = OpenSnapshot(0, 0, None)
            self._expect_backfill = False
            self._resuming = True
        self.checkpoints: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._messages = ItemMessages(keys_only=keys_only, network_byte_order=network_byte_order)
        self.item_flags = int(self._messages.tap_flags)
        """TAP flags of a MUTATION from this stream, before stamping."""

    @property
    def last_closed_checkpoint(self) -> int:
        return next(reversed(self.checkpoints), 0)

    @property
    def backfill_pending(self) -> bool:
        """A backfill is expected or under way: the client does not hold it all yet."""
        return self._expect_backfill or self.in_backfill

    @property
    def in_backfill(self) -> bool:
        return self.open is not None and self.open.checkpoint_id is None

    def feed(self, event: UprEvent) -> list[TapStreamMessage]:
        if isinstance(event, Mutation | Deletion | Expiration):
            return self._item(event)
        if isinstance(event, SnapshotMarker):
            return self._marker(event)
        if isinstance(event, StreamEnd):
            return self._close()
        if isinstance(event, SetVbucketState):
            return [*self._close(), TapVbucketSet(_in_stream(event.state), vbucket=self.vbucket)]
        raise ProtocolError(
            f"{event.NAME} has no place in a vbucket stream", field="opcode", value=event.NAME
        )

    def resume(self) -> None:
        """The upstream stream restarts after ``last_seqno``: continue what is open."""
        self._resuming = True

    def _marker(self, marker: SnapshotMarker) -> list[TapStreamMessage]:
        self.snap_start, self.snap_end = marker.start_seqno, marker.end_seqno
        self.items_in_snap = 0
        if self._resuming:
            self._resuming = False
            if self.open is not None:
                self.open = replace(self.open, end=max(self.open.end, marker.end_seqno))
                return []
        out = self._close()
        if self._expect_backfill:
            self.open = OpenSnapshot(marker.start_seqno, marker.end_seqno, None)
            out.append(TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, vbucket=self.vbucket))
        elif self.checkpoint_sync:
            checkpoint_id = next(self._ids)
            self.open = OpenSnapshot(marker.start_seqno, marker.end_seqno, checkpoint_id)
            out.append(TapCheckpointStart(checkpoint_id, vbucket=self.vbucket))
        else:
            self.open = OpenSnapshot(marker.start_seqno, marker.end_seqno, NO_CHECKPOINT)
        self._expect_backfill = False
        return out

    def advance(self, by_seqno: int) -> bool:
        """Record an item's seqno (it must grow); true when the item ends the open
        snapshot, which ``close`` then closes (the fast path's half of ``feed``)."""
        if by_seqno <= self.last_seqno:
            raise ProtocolError(
                f"vbucket {self.vbucket}: by_seqno went backwards from {self.last_seqno}",
                field="by_seqno",
                value=by_seqno,
            )
        if self.open is not None and not self.first_in_open:
            self.first_in_open = by_seqno
        self.last_seqno = by_seqno
        self.items_in_snap += 1
        return self.open is not None and by_seqno >= self.open.end

    def close(self) -> list[TapStreamMessage]:
        """Close the open snapshot, if any (after ``advance`` said it ends)."""
        return self._close()

    def _item(self, item: Mutation | Deletion | Expiration) -> list[TapStreamMessage]:
        closes = self.advance(item.by_seqno)
        message: TapStreamMessage
        if isinstance(item, Mutation):
            message = self._messages.mutation(item, self.vbucket, item.nru)
        else:
            message = ItemMessages.deletion(item, self.vbucket)
        if closes:
            return [message, *self._close()]
        return [message]

    def open_checkpoint(self, start: int, end: int, flags: int) -> int | None:
        """The fast path's ``feed`` of a marker with nothing open to close or continue:
        opens the checkpoint and returns its id (a CHECKPOINT_START to send;
        ``NO_CHECKPOINT``: nothing to send), or returns None, changing nothing,
        for a marker ``feed`` must take."""
        if self._resuming or self.open is not None:
            return None
        if self._expect_backfill:
            return None
        checkpoint_id = next(self._ids) if self.checkpoint_sync else NO_CHECKPOINT
        self.open = _open_snapshot(start, end, checkpoint_id)
        self._expect_backfill = False
        self.snap_start, self.snap_end = start, end
        self.items_in_snap = 0
        return checkpoint_id

    def close_open(self) -> OpenSnapshot | None:
        """The fast path's ``close``: the snapshot it closed (None: nothing was open);
        a checkpoint id of None means a CLOSE_BACKFILL, ``NO_CHECKPOINT`` nothing,
        else a CHECKPOINT_END."""
        snapshot, self.open = self.open, None
        first, self.first_in_open = self.first_in_open, 0
        if snapshot is not None and snapshot.checkpoint_id:
            self._remember(snapshot.checkpoint_id, first or snapshot.start, self.last_seqno)
        return snapshot

    def _close(self) -> list[TapStreamMessage]:
        snapshot = self.close_open()
        if snapshot is None:
            return []
        if snapshot.checkpoint_id is None:
            return [TapOpaque(OpaqueCode.CLOSE_BACKFILL, vbucket=self.vbucket)]
        if snapshot.checkpoint_id == NO_CHECKPOINT:
            return []
        return [TapCheckpointEnd(snapshot.checkpoint_id, vbucket=self.vbucket)]

    def _remember(self, checkpoint_id: int, start: int, end: int) -> None:
        self.checkpoints[checkpoint_id] = (start, end)
        while len(self.checkpoints) > MAX_REMEMBERED_CHECKPOINTS:
            self.checkpoints.popitem(last=False)

    def finish(self) -> list[TapStreamMessage]:
        """The stream ended without STREAM_END (e.g. a dump reached its end)."""
        return self._close()


def _in_stream(state: VBucketState) -> VBucketState:
    """The state a producer meant in a stream's SET_VBUCKET_STATE. Producers send
    only pending, then active (ep-engine 3.0 src/upr-stream.cc ``ActiveStream``
    ``takeoverState``), but 3.0 puts pending on the wire as 2 (memcached 3.0
    daemon/memcached.c ``dcp_message_set_vbucket_state``), which the engine's
    order, the released dialect's, reads as replica."""
    return VBucketState.PENDING if state is VBucketState.REPLICA else state
