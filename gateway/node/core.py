"""The store's core: the vbucket table, its configuration and the one write path.

Every change to an item, whatever its origin, goes through ``_store``: it
refuses a new key beyond ``max_items`` (NO_MEMORY), assigns the next
by_seqno (or takes the source's), records the open checkpoint's id, indexes
the item, queues its TTL for the expiry pager, appends it to the journal
when persistence is on, and finally tells the listeners ``(vbucket,
high_seqno)``. CAS values come from a hybrid clock: nanoseconds of ``now``
with the low 16 bits as a counter, never repeating or going back.

``Store`` (in ``store.py``) adds the operations on top; this module holds
what they share, so each file stays about one concern.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any, Self

from adapters.mcbp.constants import Status
from adapters.upr.failover_log import FailoverLog
from gateway.node.checkpoints import DEFAULT_HISTORY, Checkpoints
from gateway.node.expiry import ExpiryQueue
from gateway.node.items import Item, ItemKind, StoreError, VBucketState
from gateway.node.persistence import Journal, Rec, item_record
from gateway.node.recovery import recover, state_records
from gateway.node.vbucket import VBucket

DEFAULT_VBUCKETS = 64
DEFAULT_MAX_ITEMS = 2_000_000
MAX_VALUE_SIZE = 20 * 1024 * 1024
_MUTATION = ItemKind.MUTATION

Listener = Callable[[int, int], object]
"""Called as ``listener(vbucket, high_seqno)`` after each change."""


class StoreCore:
    """Configuration, the vbucket table and the shared write path (see the module doc)."""

    def __init__(
        self,
        n_vbuckets: int = DEFAULT_VBUCKETS,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        fsync: str = "batch",
        max_items: int = DEFAULT_MAX_ITEMS,
        max_value_size: int = MAX_VALUE_SIZE,
        checkpoint_items: int = 500,
        checkpoint_seconds: float = 5.0,
        checkpoint_history: int = DEFAULT_HISTORY,
        initial_state: VBucketState = VBucketState.ACTIVE,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < n_vbuckets <= 0xFFFF:
            raise ValueError(f"vbucket count must be 1..65535, not {n_vbuckets}")
        self.n_vbuckets = n_vbuckets
        self.max_items = max_items
        self.max_value_size = max_value_size
        self._rng = rng or random.Random()
        self._checkpoint_items = checkpoint_items
        self._checkpoint_seconds = checkpoint_seconds
        self._checkpoint_history = checkpoint_history
        self._vbuckets = [
            VBucket(vb, initial_state, self._new_checkpoints(), FailoverLog(self._rng))
            for vb in range(n_vbuckets)
        ]
        self._count = 0  # live items + tombstones, all vbuckets
        self._last_cas = 0
        self._expiry = ExpiryQueue()
        self._listeners: list[Listener] = []
        self._journal: Journal | None = None
        if data_dir is None:
            for v in self._vbuckets:
                v.failover.add(0)
        else:
            self._journal = Journal(data_dir, fsync=fsync)
            recover(self, self._journal)

    # -- listeners and persistence -----------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(vbucket, high_seqno)`` after every change of a vbucket.

        It runs synchronously inside the change, after it is complete (and
        journaled): it should only note the change (set an event), not raise
        or write to the store.
        """
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def flush(self) -> None:
        """Write (and sync, per the policy) everything journaled so far."""
        if self._journal is not None:
            self._journal.flush()

    def compact(self) -> None:
        """Rewrite the journal as just the current state, atomically."""
        if self._journal is not None:
            self._journal.rewrite(state_records(self))

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------

    def _vb(self, vb: int) -> VBucket:
        if 0 <= vb < self.n_vbuckets:
            return self._vbuckets[vb]
        raise StoreError(Status.NOT_MY_VBUCKET, f"no vbucket {vb}")

    def _active(self, vb: int) -> VBucket:
        v = self._vb(vb)
        if v.state is not VBucketState.ACTIVE:
            raise StoreError(Status.NOT_MY_VBUCKET, f"vbucket {vb} is {v.state.name.lower()}")
        return v

    def _receiving(self, vb: int, by_seqno: int | None) -> VBucket:
        v = self._vb(vb)
        if v.state is VBucketState.DEAD:
            raise StoreError(Status.NOT_MY_VBUCKET, f"vbucket {vb} is dead")
        if by_seqno is not None and by_seqno <= v.high_seqno:
            raise StoreError(
                Status.RANGE_ERROR, f"seqno {by_seqno} not above vbucket {vb}'s {v.high_seqno}"
            )
        return v

    def _live(self, v: VBucket, key: bytes, now: float) -> Item | None:
        """The live version of ``key``; an expired one is expired here, as reads do."""
        item = v.items.get(key)
        if item is None or item.kind is not _MUTATION:
            return None
        if 0 < item.expiration <= now:
            self._tombstone(v, item, ItemKind.EXPIRATION, now)
            return None
        return item

    def _current(self, v: VBucket, key: bytes, cas: int, now: float) -> Item:
        item = self._live(v, key, now)
        if item is None:
            raise StoreError(Status.KEY_NOT_FOUND)
        if cas and item.cas != cas:
            raise StoreError(Status.KEY_EXISTS)
        return item

    def _check_value(self, value: bytes) -> None:
        if len(value) > self.max_value_size:
            raise StoreError(Status.VALUE_TOO_LARGE, f"value of {len(value)} bytes")

    def _next_cas(self, now: float) -> int:
        # Hybrid logical clock: wall-clock nanoseconds, never repeating or going back.
        cas = max(self._last_cas + 1, int(now * 1e9) & ~0xFFFF)
        self._last_cas = cas
        return cas

    def _mutate(
        self, v: VBucket, key: bytes, value: bytes, flags: int, exp: int, dtype: int, now: float
    ) -> Item:
        self._check_value(value)
        old = v.items.get(key)
        return self._store(
            v,
            key,
            value,
            rev=old.rev_seqno + 1 if old is not None else v.max_deleted_rev + 1,
            cas=self._next_cas(now),
            flags=flags,
            expiration=exp,
            datatype=dtype,
            now=now,
        )

    def _tombstone(self, v: VBucket, old: Item, kind: ItemKind, now: float) -> Item:
        return self._store(
            v,
            old.key,
            b"",
            rev=old.rev_seqno + 1,
            cas=self._next_cas(now),
            flags=old.flags,
            expiration=0,
            kind=kind,
            delete_time=int(now),
            now=now,
        )

    def _store(
        self,
        v: VBucket,
        key: bytes,
        value: bytes,
        *,
        rev: int,
        cas: int,
        flags: int,
        expiration: int,
        lock_time: int = 0,
        datatype: int = 0,
        kind: ItemKind = _MUTATION,
        delete_time: int = 0,
        by_seqno: int | None = None,
        now: float,
    ) -> Item:
        """The one write path: seqno, checkpoint, index, journal, TTL queue, listeners."""
        if self._count >= self.max_items and key not in v.items:
            raise StoreError(Status.NO_MEMORY, f"store is full ({self.max_items} items)")
        checkpoint = v.checkpoints.before_write(now)
        seqno = v.high_seqno + 1 if by_seqno is None else by_seqno
        item = Item(
            key,
            value,
            v.id,
            seqno,
            rev,
            cas,
            flags,
            expiration,
            lock_time,
            datatype,
            kind,
            delete_time,
            checkpoint,
        )
        self._count += v.put(item)
        v.checkpoints.wrote(seqno, now)
        if expiration:
            self._expiry.push(item)
        if self._journal is not None:
            self._journal.append(item_record(item), now)
        for listener in self._listeners:
            listener(v.id, seqno)
        return item

    def _new_checkpoints(self, next_id: int = 1, high_seqno: int = 0) -> Checkpoints:
        return Checkpoints(
            max_items=self._checkpoint_items,
            max_seconds=self._checkpoint_seconds,
            history=self._checkpoint_history,
            next_id=next_id,
            high_seqno=high_seqno,
        )

    def _log(self, record: list[Any], now: float | None = None) -> None:
        if self._journal is not None:
            self._journal.append(record, now)

    def _log_failover(self, v: VBucket, now: float | None = None) -> None:
        self._log([Rec.FAILOVER, v.id, [list(e) for e in v.failover.entries]], now)

    def _notify(self, v: VBucket) -> None:
        for listener in self._listeners:
            listener(v.id, v.high_seqno)
