"""What a UPR producer streams an item from: one stored version of one key.

Every producer here keeps its items its own way (the reference node's
``Item`` in its store, the UPR front's ``LogItem`` in its log), but a
stream reads the same fields of either: ``StoredItem`` names them, so the
one ``item_event`` (``adapters.translate.upr_snapshots``) serves both. An
item is a mutation or the tombstone of a deletion or an expiration
(``ItemKind``, whose numbers the log and the node's snapshots store).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Protocol


class ItemKind(IntEnum):
    MUTATION = 0
    DELETION = 1
    EXPIRATION = 2


class StoredItem(Protocol):
    """The fields of a stored version a stream message carries."""

    @property
    def key(self) -> bytes: ...
    @property
    def value(self) -> bytes: ...
    @property
    def by_seqno(self) -> int: ...
    @property
    def rev_seqno(self) -> int: ...
    @property
    def flags(self) -> int: ...
    @property
    def expiration(self) -> int: ...
    @property
    def lock_time(self) -> int: ...
    @property
    def cas(self) -> int: ...
    @property
    def datatype(self) -> int: ...
    @property
    def kind(self) -> ItemKind: ...
    @property
    def delete_time(self) -> int: ...
