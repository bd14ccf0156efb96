"""Numbers the servers report in STAT groups, computed from the store on demand."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.node.items import VBucketState
from gateway.node.vbucket import VBucket


@dataclass(frozen=True, slots=True)
class VBucketStats:
    vbucket: int
    state: VBucketState
    uuid: int
    high_seqno: int
    items: int
    """Live items (expired ones count until the pager or a read reaches them)."""
    tombstones: int
    open_checkpoint_id: int
    last_closed_checkpoint_id: int
    checkpoints: int
    """Retained closed checkpoints plus the open one."""
    memory_bytes: int
    failover_entries: int
    snapshot_start: int
    snapshot_end: int
    purge_seqno: int

    @classmethod
    def of(cls, v: VBucket) -> VBucketStats:
        cps = v.checkpoints
        return cls(
            vbucket=v.id,
            state=v.state,
            uuid=v.failover.uuid,
            high_seqno=v.high_seqno,
            items=len(v.items) - len(v.tombstones),
            tombstones=len(v.tombstones),
            open_checkpoint_id=cps.open_id,
            last_closed_checkpoint_id=cps.last_closed_id,
            checkpoints=len(cps.listing()),
            memory_bytes=v.memory,
            failover_entries=len(v.failover),
            snapshot_start=v.snapshot[0],
            snapshot_end=v.snapshot[1],
            purge_seqno=v.purge_seqno,
        )


@dataclass(frozen=True, slots=True)
class StoreStats:
    vbuckets: int
    active: int
    replica: int
    pending: int
    dead: int
    items: int
    tombstones: int
    memory_bytes: int
    max_items: int
    expiry_queue: int
    """Entries waiting in the expiry pager's queue (some may be stale)."""

    @classmethod
    def of(cls, vbuckets: Sequence[VBucket], max_items: int, expiry_queue: int) -> StoreStats:
        states = [v.state for v in vbuckets]
        tombstones = sum(len(v.tombstones) for v in vbuckets)
        return cls(
            vbuckets=len(vbuckets),
            active=states.count(VBucketState.ACTIVE),
            replica=states.count(VBucketState.REPLICA),
            pending=states.count(VBucketState.PENDING),
            dead=states.count(VBucketState.DEAD),
            items=sum(len(v.items) for v in vbuckets) - tombstones,
            tombstones=tombstones,
            memory_bytes=sum(v.memory for v in vbuckets),
            max_items=max_items,
            expiry_queue=expiry_queue,
        )
