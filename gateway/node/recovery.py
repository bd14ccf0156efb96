"""Rebuilding a store from its journal, and the records that describe a store.

Start-up with a ``data_dir``: replay every record in order into the freshly
made vbuckets (no checks, no listeners, no journaling), then per vbucket open
a checkpoint after the highest id seen and add a failover entry at the high
seqno: a restart cannot prove that nothing was lost after the last write, so
consumers must be able to tell the histories apart. A journal that is mostly
superseded versions is compacted right away.

``state_records`` is the inverse: a header, then per vbucket one META record
and its items in seqno order. Compaction writes exactly that.

This module works on the store's internals; it is part of the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gateway.node.items import VBucketState
from gateway.node.persistence import FORMAT_VERSION, Journal, Rec, item_record, record_item
from gateway.node.vbucket import VBucket

if TYPE_CHECKING:
    from gateway.node.core import StoreCore

# Compact at start-up when the journal holds this many records beyond twice the items.
_COMPACT_SLACK = 100_000


def recover(store: StoreCore, journal: Journal) -> None:
    vbuckets = store._vbuckets
    next_checkpoint = [1] * len(vbuckets)
    seen_header = False
    for record in journal.replay():
        if not seen_header:
            _check_header(record, store.n_vbuckets, journal)
            seen_header = True
            continue
        vb = record[1]
        if not 0 <= vb < len(vbuckets):
            raise ValueError(f"{journal.path}: record for vbucket {vb} of {len(vbuckets)}")
        _replay(store, vbuckets[vb], record, next_checkpoint)
    if not seen_header:
        for v in vbuckets:
            v.failover.add(0)
        journal.rewrite(state_records(store))
        return
    journal.open()
    store._count = sum(len(v) for v in vbuckets)
    store._expiry.rebuild(
        it for v in vbuckets if v.state is VBucketState.ACTIVE for it in v.items.values()
    )
    for v in vbuckets:
        v.checkpoints = store._new_checkpoints(next_checkpoint[v.id], v.high_seqno)
        v.failover.add(v.high_seqno)
        store._log_failover(v)
    if journal.records > 2 * store._count + _COMPACT_SLACK:
        journal.rewrite(state_records(store))
    else:
        journal.flush()


def state_records(store: StoreCore) -> Iterator[list[Any]]:
    """The journal records that rebuild the store's current state."""
    yield [Rec.HEADER, FORMAT_VERSION, store.n_vbuckets]
    for v in store._vbuckets:
        yield meta_record(v)
        for item in v.since(0, v.high_seqno):
            yield item_record(item)


def meta_record(v: VBucket) -> list[Any]:
    return [
        Rec.META,
        v.id,
        int(v.state),
        v.high_seqno,
        v.max_deleted_rev,
        v.checkpoints.open_id,
        [list(e) for e in v.failover.entries],
        list(v.snapshot),
    ]


def _check_header(record: list[Any], n_vbuckets: int, journal: Journal) -> None:
    if record[0] != Rec.HEADER or len(record) < 3:
        raise ValueError(f"{journal.path} does not start with a store journal header")
    if record[1] != FORMAT_VERSION:
        raise ValueError(f"{journal.path} has format {record[1]}, expected {FORMAT_VERSION}")
    if record[2] != n_vbuckets:
        raise ValueError(f"{journal.path} holds {record[2]} vbuckets, configured {n_vbuckets}")


def _replay(store: StoreCore, v: VBucket, record: list[Any], next_checkpoint: list[int]) -> None:
    kind = record[0]
    if kind == Rec.ITEM:
        item = record_item(record)
        # After a META record the high seqno may already lie beyond the items.
        high = v.high_seqno
        v.put(item)
        v.high_seqno = max(high, item.by_seqno)
        store._last_cas = max(store._last_cas, item.cas)
        next_checkpoint[v.id] = max(next_checkpoint[v.id], item.checkpoint_id + 1)
    elif kind == Rec.META:
        _, _, state, high, max_deleted_rev, checkpoint_id, failover, snapshot = record
        v.state = VBucketState(state)
        v.high_seqno = high
        v.max_deleted_rev = max_deleted_rev
        v.failover.replace((u, s) for u, s in failover)
        v.snapshot = (snapshot[0], snapshot[1])
        next_checkpoint[v.id] = max(next_checkpoint[v.id], checkpoint_id)
    elif kind == Rec.STATE:
        v.state = VBucketState(record[2])
    elif kind == Rec.FAILOVER:
        v.failover.replace((u, s) for u, s in record[2])
    elif kind == Rec.ROLLBACK:
        v.rollback(record[2])
    elif kind == Rec.RESET:
        v.clear()
        next_checkpoint[v.id] = 1
    elif kind == Rec.PURGE:
        v.purge(record[2])
    elif kind == Rec.SNAPSHOT:
        v.snapshot = (record[2], record[3])
    else:
        raise ValueError(f"unknown journal record type {kind}")
