"""Item records, their kinds, vbucket states and the store's error type.

An ``Item`` is one version of one key in one vbucket, exactly what a stream
sends: a mutation, or a tombstone left by a deletion or an expiration.
Items are immutable; every change makes a new one with a new by_seqno.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapters.errors import GatewayError
from adapters.mcbp.constants import Status, VBucketState, status_name
from adapters.upr.items import ItemKind

__all__ = ["Item", "ItemKind", "StoreError", "VBucketState"]


@dataclass(frozen=True, slots=True)
class Item:
    key: bytes
    value: bytes
    vbucket: int
    by_seqno: int
    rev_seqno: int
    cas: int
    flags: int
    """u32 as the client sent it; never byte-swapped here."""
    expiration: int
    """Absolute epoch seconds, 0 = never."""
    lock_time: int = 0
    datatype: int = 0
    kind: ItemKind = ItemKind.MUTATION
    delete_time: int = 0
    """Epoch seconds of the deletion or expiration (tombstones only)."""
    checkpoint_id: int = 0

    @property
    def deleted(self) -> bool:
        return self.kind != ItemKind.MUTATION

    def expired_at(self, now: float) -> bool:
        return self.kind == ItemKind.MUTATION and 0 < self.expiration <= now


class StoreError(GatewayError):
    """A store operation refused, with the memcached status a server answers with."""

    def __init__(self, status: Status, message: str = "") -> None:
        self.status = status
        self.message = message or status_name(status).replace("_", " ")
        super().__init__(f"{status_name(status)}: {self.message}")
