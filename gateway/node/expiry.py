"""The expiry pager's queue: items with a TTL, soonest first.

A heap of (expiration, vbucket, by_seqno, key) pushed on every write of an
item with a TTL. Entries are never updated in place: when the item changes,
its entry goes stale and is recognised on pop because the vbucket's latest
version of the key no longer has that by_seqno. ``due`` therefore costs
O(log n) per entry, not a scan of the store. The heap is rebuilt from the
live items when stale entries outnumber them, which bounds its size.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from gateway.node.items import Item, ItemKind

_MIN_REBUILD = 1024


class ExpiryQueue:
    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, bytes]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: Item) -> None:
        if item.expiration and item.kind is ItemKind.MUTATION:
            heapq.heappush(self._heap, (item.expiration, item.vbucket, item.by_seqno, item.key))

    def due(self, now: float) -> Iterator[tuple[int, int, bytes]]:
        """Pop (vbucket, by_seqno, key) of entries expired at ``now``, soonest first.

        Entries may be stale; the caller checks them against the vbucket.
        Stop iterating at any time: unconsumed entries stay queued.
        """
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, vb, seqno, key = heapq.heappop(heap)
            yield vb, seqno, key

    def needs_rebuild(self, live_items: int) -> bool:
        return len(self._heap) > max(_MIN_REBUILD, 2 * live_items)

    def rebuild(self, items: Iterable[Item]) -> None:
        self._heap = [
            (it.expiration, it.vbucket, it.by_seqno, it.key)
            for it in items
            if it.expiration and it.kind is ItemKind.MUTATION
        ]
        heapq.heapify(self._heap)
