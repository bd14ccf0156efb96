"""UPR messages of a write framed while the ingest logs its items, for the stream that follows.

A consumer that keeps up reads each write of its vbucket's log right after
it is published, and frames it (``log_to_upr_fast.BatchCut``: one unpack and
one pack per item from the block bytes). The ingest's fast path
(``tap_to_log_fast``) holds every field of an item in locals as it packs the
item's record, so it can pack the item's UPR message too, for the one
encoder (stream opaque, dialect, consumer settings) that last read the
vbucket's in-memory tail, at a fraction of that cost. ``Framing`` keeps those
messages for one write buffer and cuts them into snapshots as ``BatchCut``
does for a read of exactly that write (from its first item to its last, no
item or byte limit); a property test holds the bytes to ``BatchCut``'s.

Only a write made of items the fast path logged inline (mutations) and marks
is framed so: a delete or an item of the event path ends the framing of the
write (``WriteBuffer`` drops it), and the stream frames that write itself.
Within such a write every item has the next seqno (marks have none). As in
``BatchCut`` a snapshot ends at an item whose backfill bit or checkpoint id
differs from the snapshot's (only a mark changes those, and the fast path
looks at them once per run of a vbucket's items, each run ending at a mark:
``tap_to_log_fast``), at the first item of a checkpoint, and at an item
whose key the snapshot holds already (its previous version's seqno is the
snapshot's start or later: ``TapToUpr``'s index says so).
"""

from __future__ import annotations

from adapters.mcbp.constants import Magic
from adapters.translate.log_to_upr_fast import BatchEncoder
from adapters.upr.constants import SnapshotFlags

_REQUEST = Magic.REQUEST.value
_DISK = SnapshotFlags.DISK.value
_MEMORY = SnapshotFlags.MEMORY.value
_CHECKPOINT = SnapshotFlags.CHECKPOINT.value
MARKER_SIZE = 24 + 20
"""Bytes of a SNAPSHOT_MARKER message (header and extras)."""

Framed = tuple[bytes, int, int, int, float, int]
"""A write framed: (the messages, markers, items, last item seqno, arrival of the first
item, bytes of keys and values). Bytes, ints and a float: the collector does not walk it."""


class Framing:
    """The UPR messages of one write buffer's items, framed as the ingest logs them."""

    __slots__ = ("arrival", "at", "backfill", "checkpoint", "encoder", "ext", "first", "flags",
                 "markers", "op", "opaque", "pack", "parts", "start", "vbucket")  # fmt: skip

    def __init__(self, encoder: BatchEncoder) -> None:
        self.encoder = encoder
        op, mutation, ext = encoder.mutation_layout()
        self.op = op
        """MUTATION's opcode in the encoder's dialect."""
        self.pack = mutation.pack
        """Header and extras of a MUTATION (``BatchCut.block``'s)."""
        self.ext = ext
        self.vbucket = encoder.vbucket
        self.opaque = encoder.opaque
        self.parts: list[bytes] = []
        """Marker placeholders, message headers, keys with values, in order."""
        self.at = -1
        """Index in ``parts`` of the open snapshot's marker (-1: no item yet)."""
        self.start = -1
        """Seqno of the open snapshot's first item (-1: none)."""
        self.first = 0
        self.flags = 0
        self.backfill = 0
        """The open snapshot's backfill bit (1: backfill)."""
        self.checkpoint = 0
        """The open snapshot's checkpoint id."""
        self.markers = 0
        self.arrival = 0.0

    def fits(self, bits: int, checkpoint: int) -> bool:
        """Whether items of these backfill bit and checkpoint id go on in the open snapshot
        (their keys and the checkpoint's first item aside)."""
        return self.at >= 0 and self.backfill == bits & 1 and self.checkpoint == checkpoint

    def open(self, seqno: int, bits: int, checkpoint: int, now: float) -> int:
        """A snapshot begins at item ``seqno`` (its ``BLOCK_ITEM`` bits: 1 backfill, 2 the
        first of a checkpoint; its checkpoint id): the open one's marker is filled in.
        Returns ``seqno``."""
        parts = self.parts
        if self.at >= 0:
            parts[self.at] = self._marker(seqno - 1)
        else:
            self.first = seqno
            self.arrival = now
        self.at = len(parts)
        parts.append(b"")
        self.markers += 1
        self.start = seqno
        self.backfill = bits & 1
        self.checkpoint = checkpoint
        self.flags = _DISK if bits & 1 else (_MEMORY | _CHECKPOINT if bits & 2 else _MEMORY)
        return seqno

    def _marker(self, last: int) -> bytes:
        enc = self.encoder
        return enc.marker_struct().pack(_REQUEST, enc.marker_opcode(), 0, 20, 0, self.vbucket, 20,
                                        self.opaque, 0, self.start, last, self.flags)  # fmt: skip

    def finish(self, items: int, first: int, last: int) -> Framed | None:
        """The write of ``items`` items, seqnos ``first`` to ``last``, framed; None when the
        messages do not stand for exactly those (not every item went through here)."""
        if self.at < 0 or self.first != first or last - first + 1 != items:
            return None
        self.parts[self.at] = self._marker(last)
        self.at = -1
        data = b"".join(self.parts)
        kv = len(data) - self.markers * MARKER_SIZE - items * (24 + self.ext)
        if kv < 0:
            return None
        return data, self.markers, items, last, self.arrival, kv
