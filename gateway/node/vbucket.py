"""One vbucket's items: the latest version of each key, indexed by seqno.

Two structures hold the same items:

- ``items``: key -> latest Item (a mutation or a tombstone), for point ops;
- ``_log``: a list of Items in by_seqno order, for streams.

Seqnos only grow, so a new version is appended to ``_log``; the version it
replaces stays in the list but is *stale*, recognisable because
``items[key] is not it``. A range read bisects to its start (O(log n)) and
skips stale entries; once they make up half the list it is rebuilt in one
pass, so updates stay amortised O(1). The result is what a deduplicating
node serves: each key at most once, at its latest seqno, and a stream from
seqno S sees exactly the keys whose latest by_seqno is > S.

Rollback keeps only latest versions too: a key whose latest version is newer
than the rollback point disappears entirely, where a real node would fall
back to its older version on disk. Consumers of this node re-stream from the
rollback point and get the key again.
"""

from __future__ import annotations

from bisect import bisect_right
from operator import attrgetter

from adapters.upr.failover_log import FailoverLog
from gateway.node.checkpoints import Checkpoints
from gateway.node.items import Item, ItemKind, VBucketState

# Bytes per item beyond the key and value contents: the Item object, its
# ints, two bytes-object headers, its dict slot and its seqno-index slot
# (measured with tracemalloc on CPython 3.11: ~440 bytes for a 14-byte key
# and a 100-byte value).
ITEM_OVERHEAD = 320
_MIN_COMPACT = 1024
_SEQNO = attrgetter("by_seqno")


class VBucket:
    __slots__ = (
        "_log",
        "_stale",
        "checkpoints",
        "failover",
        "high_seqno",
        "id",
        "items",
        "max_deleted_rev",
        "memory",
        "purge_seqno",
        "snapshot",
        "state",
        "state_changes",
        "tombstones",
    )

    def __init__(
        self, vbid: int, state: VBucketState, checkpoints: Checkpoints, failover: FailoverLog
    ) -> None:
        self.id = vbid
        self.state = state
        # State changes UPR streams are told of (all but a takeover's own hand-off).
        self.state_changes = 0
        self.checkpoints = checkpoints
        self.failover = failover
        self.items: dict[bytes, Item] = {}
        self._log: list[Item] = []
        self._stale = 0
        self.high_seqno = 0
        self.tombstones: set[bytes] = set()
        self.memory = 0
        # Rev seqnos of purged tombstones live on here, so a re-created key
        # still gets a rev seqno above every version a replica may have seen.
        self.max_deleted_rev = 0
        # The highest seqno of a purged tombstone: a consumer that starts below it
        # may have missed a delete, so it must start over (the purge rule).
        self.purge_seqno = 0
        # The last snapshot a consumer received into this vbucket (resume point).
        self.snapshot = (0, 0)

    def __len__(self) -> int:
        return len(self.items)

    def put(self, item: Item) -> int:
        """Make ``item`` the latest version of its key; 1 if the key is new, else 0.

        The caller guarantees ``item.by_seqno > high_seqno``.
        """
        key = item.key
        old = self.items.get(key)
        self.items[key] = item
        self._log.append(item)
        self.high_seqno = item.by_seqno
        self.memory += len(item.value)
        if item.kind is not ItemKind.MUTATION:
            self.tombstones.add(key)
        elif old is not None and old.kind is not ItemKind.MUTATION:
            self.tombstones.discard(key)
        if old is None:
            self.memory += len(key) + ITEM_OVERHEAD
            return 1
        self.memory -= len(old.value)
        self._went_stale(1)
        return 0

    def remove(self, key: bytes) -> Item | None:
        """Forget ``key`` entirely (tombstone purge); the item removed, if any."""
        old = self.items.pop(key, None)
        if old is not None:
            self.tombstones.discard(key)
            self.memory -= len(key) + len(old.value) + ITEM_OVERHEAD
            self._went_stale(1)
        return old

    def since(self, start: int, end: int, limit: int | None = None) -> list[Item]:
        """Latest versions with ``start < by_seqno <= end``, in seqno order."""
        log = self._log
        items = self.items
        lo = bisect_right(log, start, key=_SEQNO)
        hi = bisect_right(log, end, lo=lo, key=_SEQNO)
        if limit is None:
            return [it for it in log[lo:hi] if items.get(it.key) is it]
        out: list[Item] = []
        while lo < hi and len(out) < limit:
            # Read in slices near the size still wanted: cheap when few are stale.
            step = min(hi, lo + max(64, limit - len(out)))
            out.extend([it for it in log[lo:step] if items.get(it.key) is it])
            lo = step
        del out[limit:]
        return out

    def rollback(self, seqno: int) -> int:
        """Drop every item with by_seqno > ``seqno``; how many keys went."""
        log = self._log
        cut = bisect_right(log, seqno, key=_SEQNO)
        removed = 0
        for item in log[cut:]:
            if self.items.get(item.key) is item:
                del self.items[item.key]
                self.tombstones.discard(item.key)
                self.memory -= len(item.key) + len(item.value) + ITEM_OVERHEAD
                removed += 1
        self._stale -= len(log) - cut - removed
        del log[cut:]
        self.high_seqno = min(self.high_seqno, seqno)
        return removed

    def clear(self) -> int:
        """Drop every item and start seqnos from 0; how many keys went."""
        removed = len(self.items)
        self.items = {}
        self._log = []
        self._stale = 0
        self.tombstones = set()
        self.memory = 0
        self.high_seqno = 0
        self.max_deleted_rev = 0
        self.purge_seqno = 0
        self.snapshot = (0, 0)
        return removed

    def purge(self, older_than: float) -> int:
        """Forget tombstones deleted before ``older_than``; how many went."""
        items = self.items
        doomed = [k for k in self.tombstones if items[k].delete_time < older_than]
        for key in doomed:
            item = self.remove(key)
            if item is not None:
                self.max_deleted_rev = max(self.max_deleted_rev, item.rev_seqno)
                self.purge_seqno = max(self.purge_seqno, item.by_seqno)
        return len(doomed)

    def _went_stale(self, count: int) -> None:
        self._stale += count
        if self._stale > _MIN_COMPACT and self._stale * 2 > len(self._log):
            items = self.items
            self._log = [it for it in self._log if items.get(it.key) is it]
            self._stale = 0
