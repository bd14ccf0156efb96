"""The write buffer of a vbucket log: records framed for its active segment, not yet written.

Items go into blocks (``segments.buffer_items``), marks as rows of their own,
each closing the open block. Besides the bytes, the buffer keeps what
``VbLog.write`` needs to account for them once they are in the file: the
items' count and seqno range, and the (seqno, offset) pairs due in the
segment's sparse index (every ``SPARSE_EVERY``-th item of the segment).

The ingest's fast path (``adapters.translate.tap_to_log_fast``) packs items
into ``data`` itself, a vbucket's run at a time: it opens blocks with
``new_block``, names the items due in the sparse index (``due`` counts down
to the next one), and reports the run with ``added``. The property tests of
``test_ingest_fast`` hold the bytes and the index to what ``add_items``
makes of the same items.

Framing (``adapters.translate.log_preframing``): while ``encoder`` names the
stream that last read the log's in-memory tail, the fast path also frames the
buffered items' UPR messages for it (``framing``); an item of the event path
drops that, and so does an encoder set while records are buffered: the next
buffer is framed again.
"""

from __future__ import annotations

from adapters.translate.log_preframing import Framed, Framing
from adapters.translate.log_records import LogItem, LogMark
from adapters.translate.log_to_upr_fast import BatchEncoder
from gateway.fronts.upr.segments import (
    BLOCK_BYTES,
    BLOCK_OPEN,
    SPARSE_EVERY,
    buffer_items,
    close_block,
    frame_mark_fields,
)


class WriteBuffer:
    """Records of one vbucket log framed and not yet handed to its segment file."""

    __slots__ = (
        "block", "block_bytes", "data", "due", "encoder", "first", "framing", "high", "items",
        "sparse", "sparse_every", "total",
    )  # fmt: skip

    def __init__(self) -> None:
        self.data = bytearray()
        self.block = -1
        """Offset in ``data`` of the block of items open at its end (-1: none)."""
        self.block_bytes = BLOCK_BYTES
        """A block is closed once it holds more than this many bytes."""
        self.sparse: list[tuple[int, int]] = []
        """(seqno, offset in ``data``) of buffered items due in the sparse index."""
        self.sparse_every = SPARSE_EVERY
        self.due = 0
        """Items to buffer before the next one the sparse index names (0: the next)."""
        self.items = 0
        """Items buffered."""
        self.first = 0
        """Seqno of the first item buffered (valid while ``items``)."""
        self.high = 0
        """Seqno of the last item buffered (0: none since the log opened)."""
        self.total = 0
        """Items ever buffered (``VbLog.items_total``)."""
        self.encoder: BatchEncoder | None = None
        """The stream encoder the buffered items are framed for (None: none)."""
        self.framing: Framing | None = None
        """The buffered items' UPR messages, while every item went through the fast path."""

    def __bool__(self) -> bool:
        return bool(self.data)

    def frame_for(self, encoder: BatchEncoder | None) -> None:
        """Frame the items buffered from now on for ``encoder`` (None: stop framing);
        what is buffered already is not framed, so this buffer's framing ends."""
        if encoder is not self.encoder:
            self.encoder = encoder
            self.framing = Framing(encoder) if encoder is not None and not self.data else None

    def framed(self) -> Framed | None:
        """The buffered items framed for ``encoder`` (call before ``clear``), if all were."""
        framing = self.framing
        if framing is None or not self.items:
            return None
        return framing.finish(self.items, self.first, self.high)

    def add_items(self, items: list[LogItem]) -> None:
        """Buffer items the translator made, in order."""
        self.framing = None  # the event path's items are not framed
        every = self.sparse_every
        self.block = buffer_items(
            self.data, self.block, items, self.due, self.sparse, self.block_bytes, every
        )
        self.due = (self.due - len(items)) % every
        self.added(len(items), items[0].by_seqno, items[-1].by_seqno)

    def added(self, count: int, first: int, high: int) -> None:
        """``count`` items, seqnos ``first`` to ``high``, were packed into ``data``."""
        if not self.items:
            self.first = first
        self.items += count
        self.high = high
        self.total += count

    def new_block(self) -> int:
        """Close the open block (if any) and open one at the end; its offset."""
        data = self.data
        close_block(data, self.block)
        self.block = block = len(data)
        data += BLOCK_OPEN
        return block

    def add_mark(self, mark: LogMark) -> None:
        """Buffer one mark the translator made."""
        self.add_mark_fields(int(mark.kind), mark.value)

    def add_mark_fields(self, kind: int, value: int) -> None:
        """Buffer the mark ``LogMark(kind, value)`` (the ingest's fast path: no mark
        object for the two checkpoint marks of each live item)."""
        if self.block >= 0:
            close_block(self.data, self.block)
            self.block = -1
        self.data += frame_mark_fields(kind, value)

    def close_block(self) -> None:
        close_block(self.data, self.block)
        self.block = -1

    def realign(self, items_before: int) -> None:
        """The active segment holds ``items_before`` items before the buffered ones
        (it changed): the sparse index names every ``SPARSE_EVERY``-th of its items."""
        self.due = -(items_before + self.items) % self.sparse_every

    def clear(self) -> None:
        """Everything buffered was handed to the file."""
        self.data.clear()
        self.sparse.clear()
        self.items = 0
        encoder = self.encoder
        self.framing = Framing(encoder) if encoder is not None else None

    def spoil(self) -> None:
        """Records went back into ``data`` (a failed fsync): they are not framed."""
        self.framing = None
