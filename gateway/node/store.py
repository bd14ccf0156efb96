"""The reference node's vbucket store: pure, synchronous, clock-free.

Theory of operation. The store holds N vbuckets (``VBucket``), each with a
state, a by_seqno counter, the latest version of every key (mutations and
tombstones) indexed by seqno, checkpoints and a failover log. Every change,
whatever its origin, goes through one write path (``StoreCore._store`` in
``core.py``) that assigns the next by_seqno (or takes the source's), records
the open checkpoint's id, appends the item to the journal when persistence
is on, queues TTLs for the expiry pager and then tells the listeners
``(vbucket, high_seqno)``.

Two kinds of writers, as on a real node:

- clients (``set``/``add``/``replace``/``delete``/``touch``/``get``) with
  memcached semantics, only on ACTIVE vbuckets; the store picks CAS (a hybrid
  clock: nanoseconds of ``now`` with the low 16 bits as a counter, always
  increasing) and rev_seqno (+1 per change of a key);
- replication (``apply_mutation``/``apply_deletion``, ``reset_vbucket``,
  ``rollback``) on any vbucket that is not DEAD, keeping the source's CAS,
  rev_seqno and metadata, and its by_seqno when a UPR consumer passes it.

Time never comes from a clock: each call takes ``now`` (epoch seconds).
Expired items stay as they are until the expiry pager (``expire``) or a
read reaches them, which turns them into EXPIRATION tombstones with new
seqnos. Tombstones stay until ``purge_tombstones``. ``max_items`` bounds
live items plus tombstones; a write that would add a key beyond it fails
with NO_MEMORY.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from adapters.mcbp.constants import Status
from adapters.mcbp.vbucket import vbucket_of
from gateway.node.checkpoints import Checkpoint
from gateway.node.core import DEFAULT_MAX_ITEMS, DEFAULT_VBUCKETS, Listener, StoreCore
from gateway.node.items import Item, ItemKind, StoreError, VBucketState
from gateway.node.persistence import Rec
from gateway.node.store_stats import StoreStats, VBucketStats
from gateway.node.vbucket import VBucket

__all__ = [
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_VBUCKETS",
    "Checkpoint",
    "Item",
    "ItemKind",
    "Listener",
    "Store",
    "StoreError",
    "StoreStats",
    "VBucketState",
    "VBucketStats",
    "vbucket_of",
]

EXPIRY_BATCH = 10_000
_MUTATION = ItemKind.MUTATION


class Store(StoreCore):
    """N vbuckets with memcached, replication, stream and failover operations.

    Construction: ``Store(n_vbuckets=64, *, data_dir=None, fsync="batch",
    max_items=2_000_000, checkpoint_items=500, checkpoint_seconds=5.0,
    initial_state=ACTIVE, rng=None)``. With ``data_dir`` the store replays
    its journal and adds a failover entry to every vbucket; ``initial_state``
    then applies only to a new data directory.
    """

    # -- memcached commands (ACTIVE vbuckets only) ---------------------------

    def get(self, vb: int, key: bytes, now: float) -> Item:
        item = self._live(self._active(vb), key, now)
        if item is None:
            raise StoreError(Status.KEY_NOT_FOUND)
        return item

    def set(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiration: int = 0,
        cas: int = 0,
        datatype: int = 0,
        now: float,
    ) -> Item:
        """Store unconditionally, or only over CAS ``cas`` when it is nonzero."""
        v = self._active(vb)
        if cas:
            self._current(v, key, cas, now)
        return self._mutate(v, key, value, flags, expiration, datatype, now)

    def add(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiration: int = 0,
        cas: int = 0,
        datatype: int = 0,
        now: float,
    ) -> Item:
        """Store only if the key has no live (unexpired, undeleted) version.

        An add with a CAS makes no sense; ep-engine answers NOT_STORED.
        """
        v = self._active(vb)
        if cas:
            raise StoreError(Status.ITEM_NOT_STORED, "add with a CAS")
        old = v.items.get(key)
        if old is not None and old.kind is _MUTATION and not old.expired_at(now):
            raise StoreError(Status.KEY_EXISTS)
        return self._mutate(v, key, value, flags, expiration, datatype, now)

    def replace(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiration: int = 0,
        cas: int = 0,
        datatype: int = 0,
        now: float,
    ) -> Item:
        """Store only over a live version (and its CAS when ``cas`` is nonzero)."""
        v = self._active(vb)
        self._current(v, key, cas, now)
        return self._mutate(v, key, value, flags, expiration, datatype, now)

    def delete(self, vb: int, key: bytes, *, cas: int = 0, now: float) -> Item:
        """Replace a live version with a DELETION tombstone; returns the tombstone."""
        v = self._active(vb)
        old = self._current(v, key, cas, now)
        return self._tombstone(v, old, ItemKind.DELETION, now)

    def touch(self, vb: int, key: bytes, expiration: int, *, now: float) -> Item:
        """Give a live item a new expiration (a new version, as on a real node)."""
        v = self._active(vb)
        old = self._current(v, key, 0, now)
        return self._store(
            v,
            key,
            old.value,
            rev=old.rev_seqno + 1,
            cas=self._next_cas(now),
            flags=old.flags,
            expiration=expiration,
            datatype=old.datatype,
            now=now,
        )

    # -- replication (any state but DEAD) ------------------------------------

    def apply_mutation(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int,
        expiration: int,
        cas: int,
        rev_seqno: int,
        by_seqno: int | None = None,
        lock_time: int = 0,
        datatype: int = 0,
        now: float,
    ) -> Item:
        """Apply a replicated mutation; ``by_seqno=None`` assigns the next local seqno."""
        v = self._receiving(vb, by_seqno)
        self._check_value(value)
        self._last_cas = max(self._last_cas, cas)
        return self._store(
            v,
            key,
            value,
            rev=rev_seqno,
            cas=cas,
            flags=flags,
            expiration=expiration,
            lock_time=lock_time,
            datatype=datatype,
            by_seqno=by_seqno,
            now=now,
        )

    def apply_deletion(
        self,
        vb: int,
        key: bytes,
        *,
        cas: int,
        rev_seqno: int,
        by_seqno: int | None = None,
        kind: ItemKind = ItemKind.DELETION,
        delete_time: int | None = None,
        now: float,
    ) -> Item:
        """Apply a replicated deletion or expiration (a tombstone even for unknown keys).

        ``delete_time`` None or 0 (3.0 deletions carry none) means ``now``.
        """
        if kind is _MUTATION:
            raise ValueError("apply_deletion needs a DELETION or EXPIRATION kind")
        v = self._receiving(vb, by_seqno)
        self._last_cas = max(self._last_cas, cas)
        old = v.items.get(key)
        return self._store(
            v,
            key,
            b"",
            rev=rev_seqno,
            cas=cas,
            flags=old.flags if old is not None else 0,
            expiration=0,
            kind=kind,
            delete_time=delete_time or int(now),
            by_seqno=by_seqno,
            now=now,
        )

    def reset_vbucket(self, vb: int) -> None:
        """Empty ``vb`` as a fresh vbucket (TAP OPAQUE initial vbucket stream).

        Seqnos restart from 0 and checkpoint ids from 1; the vbucket gets a new
        uuid and a one-entry failover log, since its old history is gone.
        """
        v = self._vb(vb)
        self._count -= v.clear()
        v.checkpoints = self._new_checkpoints()
        v.failover.replace(())
        v.failover.add(0)
        self._log([Rec.RESET, vb])
        self._log_failover(v)
        self._notify(v)

    def rollback(self, vb: int, seqno: int) -> int:
        """Drop every item with by_seqno > ``seqno``; returns the new high seqno.

        Only latest versions are kept, so a key whose latest version is newer
        than ``seqno`` is removed entirely (a real node would restore its older
        version from disk); the consumer re-streams it from ``seqno``.
        """
        v = self._vb(vb)
        if seqno >= v.high_seqno:
            return v.high_seqno
        self._count -= v.rollback(seqno)
        v.checkpoints.rollback(seqno)
        v.failover.prune(seqno)
        if not len(v.failover):
            v.failover.add(seqno)
        self._log([Rec.ROLLBACK, vb, seqno])
        self._log_failover(v)
        self._notify(v)
        return v.high_seqno

    # -- streams -------------------------------------------------------------

    def vbucket(self, vb: int) -> VBucket | None:
        """The vbucket itself, for read-only use (``None`` if out of range)."""
        return self._vbuckets[vb] if 0 <= vb < self.n_vbuckets else None

    def high_seqno(self, vb: int) -> int:
        return self._vb(vb).high_seqno

    def items_since(
        self, vb: int, start: int, end: int | None = None, limit: int | None = None
    ) -> list[Item]:
        """Latest versions with ``start < by_seqno <= end`` (default: high seqno), in order."""
        v = self._vb(vb)
        return v.since(start, v.high_seqno if end is None else end, limit)

    def lookup(self, vb: int, key: bytes) -> Item | None:
        """The latest version of ``key`` as stored (tombstones too, no expiry, any state)."""
        return self._vb(vb).items.get(key)

    def checkpoints(self, vb: int) -> list[Checkpoint]:
        """Retained closed checkpoints, oldest first, then the open one."""
        return self._vb(vb).checkpoints.listing()

    def checkpoint_of(self, vb: int, seqno: int) -> Checkpoint | None:
        """The checkpoint holding ``seqno``; ``None`` if older than the history kept."""
        return self._vb(vb).checkpoints.containing(seqno)

    def close_checkpoint(self, vb: int, next_id: int | None = None) -> int:
        """Close ``vb``'s open checkpoint now; ``next_id`` follows a source's ids."""
        return self._vb(vb).checkpoints.close(next_id)

    def maybe_close_checkpoints(self, now: float) -> int:
        """Close checkpoints whose time is up; also flushes a batched journal when due."""
        closed = sum(v.checkpoints.maybe_close(now) for v in self._vbuckets)
        if self._journal is not None:
            self._journal.maybe_flush(now)
        return closed

    # -- states and failover -------------------------------------------------

    def state(self, vb: int) -> VBucketState:
        return self._vb(vb).state

    def state_changes(self, vb: int) -> int:
        """How many state changes of ``vb`` its UPR streams were told of: a stream
        ends STATE_CHANGED once this moves past what it was at its request."""
        return self._vb(vb).state_changes

    def set_state(
        self, vb: int, state: VBucketState, *, now: float, notify_streams: bool = True
    ) -> None:
        """Change state; becoming ACTIVE starts a new history (failover entry).

        ``notify_streams=False`` is a UPR takeover stream's own hand-off: 3.0
        ``ActiveStream::setVBucketStateAckRecieved`` (src/upr-stream.cc) calls
        ``EventuallyPersistentStore::setVBucketState`` (src/ep.cc) with
        ``notify_upr`` false, so ``UprConnMap::vbucketStateChanged`` ends no stream.
        """
        v = self._vb(vb)
        state = VBucketState(state)
        if state is v.state:
            return
        was_active = v.state is VBucketState.ACTIVE
        v.state = state
        if notify_streams:
            v.state_changes += 1
        self._log([Rec.STATE, vb, int(state)], now)
        if state is VBucketState.ACTIVE and not was_active:
            v.checkpoints.close()
            self.failover(vb, now)
            # The pager skips inactive vbuckets; queue this one's TTLs again.
            for item in v.items.values():
                self._expiry.push(item)
        self._notify(v)

    def uuid(self, vb: int) -> int:
        return self._vb(vb).failover.uuid

    def failover_log(self, vb: int) -> tuple[tuple[int, int], ...]:
        """(uuid, seqno) pairs, newest first."""
        return self._vb(vb).failover.entries

    def failover(self, vb: int, now: float | None = None) -> int:
        """Start a new history at the high seqno (explicit failover); the new uuid."""
        v = self._vb(vb)
        uuid = v.failover.add(v.high_seqno)
        self._log_failover(v, now)
        return uuid

    def replace_failover_log(self, vb: int, entries: Iterable[tuple[int, int]]) -> None:
        """Adopt a producer's failover log (a UPR consumer on stream accept)."""
        v = self._vb(vb)
        v.failover.replace(entries)
        self._log_failover(v)

    def purge_seqno(self, vb: int) -> int:
        """The highest seqno of a tombstone purged from ``vb`` (0: none)."""
        return self._vb(vb).purge_seqno

    def rollback_decision(
        self, vb: int, start: int, uuid: int, snap_start: int, snap_end: int
    ) -> int | None:
        """Where a consumer asking for this stream must roll back to; ``None``: nowhere."""
        v = self._vb(vb)
        return v.failover.decide(v.high_seqno, start, uuid, snap_start, snap_end)

    def snapshot(self, vb: int) -> tuple[int, int]:
        """The last snapshot range a consumer received into ``vb`` (its resume point)."""
        return self._vb(vb).snapshot

    def set_snapshot(self, vb: int, start: int, end: int) -> None:
        self._vb(vb).snapshot = (start, end)
        self._log([Rec.SNAPSHOT, vb, start, end])

    # -- housekeeping --------------------------------------------------------

    def expire(self, now: float, limit: int = EXPIRY_BATCH) -> list[Item]:
        """Turn up to ``limit`` items expired at ``now`` into EXPIRATION tombstones.

        Active vbuckets only, as the expiry pager: replicas get expirations
        from their active copy.
        """
        expired: list[Item] = []
        vbuckets = self._vbuckets
        if limit > 0:
            for vb, seqno, key in self._expiry.due(now):
                v = vbuckets[vb]
                item = v.items.get(key)
                if item is None or item.by_seqno != seqno or not item.expired_at(now):
                    # Changed since it was queued; a rollback can even hand its
                    # seqno to a newer version without a TTL.
                    continue
                if v.state is VBucketState.ACTIVE:
                    expired.append(self._tombstone(v, item, ItemKind.EXPIRATION, now))
                    if len(expired) >= limit:
                        break
        if self._expiry.needs_rebuild(self._count):
            self._expiry.rebuild(
                it for v in vbuckets if v.state is VBucketState.ACTIVE for it in v.items.values()
            )
        return expired

    def purge_tombstones(self, older_than: float, vb: int | None = None) -> int:
        """Forget tombstones deleted before ``older_than``; how many went."""
        targets = self._vbuckets if vb is None else [self._vb(vb)]
        purged = 0
        for v in targets:
            count = v.purge(older_than)
            if count:
                purged += count
                self._log([Rec.PURGE, v.id, older_than])
        self._count -= purged
        return purged

    # -- listeners, stats, sample data, persistence --------------------------

    def vbucket_stats(self, vb: int) -> VBucketStats:
        return VBucketStats.of(self._vb(vb))

    def stats(self) -> StoreStats:
        return StoreStats.of(self._vbuckets, self.max_items, len(self._expiry))

    def populate_sample(
        self,
        n_items: int,
        *,
        value_size: int = 100,
        rng: random.Random | None = None,
        now: float = 0.0,
        prefix: bytes = b"sample",
    ) -> int:
        """Write keys ``<prefix>::000000``.. to their (active) vbuckets; how many were written."""
        rng = rng or random.Random(0)
        written = 0
        n = self.n_vbuckets
        for i in range(n_items):
            key = b"%s::%06d" % (prefix, i)
            vb = vbucket_of(key, n)
            if self._vbuckets[vb].state is VBucketState.ACTIVE:
                self.set(vb, key, rng.randbytes(value_size), now=now)
                written += 1
        return written
