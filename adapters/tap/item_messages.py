"""The TAP message a 2.x producer sent for one item version.

One builder for every TAP producer here: the TAP front's ``UprToTap`` (items
arriving as UPR) and the reference node's ``TapStream`` (items read from its
store). As ep-engine 2.x's TAP producer did (src/tapconnection.cc): with
keys-only, no value and the NO_VALUE flag; item flags byte-swapped to host
order unless the client asked for network order (FIX_FLAG_BYTEORDER), in
which case they travel as stored with NETWORK_BYTE_ORDER set; a deletion or
an expiration is a DELETE. The header's datatype is 0 whatever the item's:
memcached 2.5 ``ship_tap_log`` zeroed the header, and no 2.x receiver read
the byte. The messages are unstamped (the sans-IO
``TapProducer`` adds sequence numbers and ack requests). ``stored_flags`` is
the way back, for every receiver: a MUTATION's flags as the client set them.
"""

from __future__ import annotations

from typing import Protocol

from adapters.tap.constants import NO_TAP_FLAGS, TapFlags, swap32
from adapters.tap.events import TapDelete, TapMutation

__all__ = ["ItemMessages", "StoredMutation", "StoredRemoval", "stored_flags"]


class StoredRemoval(Protocol):
    """What a DELETE carries of a deletion or an expiration (a UPR message or a
    stored tombstone alike)."""

    @property
    def key(self) -> bytes: ...
    @property
    def cas(self) -> int: ...
    @property
    def rev_seqno(self) -> int: ...


class StoredMutation(StoredRemoval, Protocol):
    """What a MUTATION carries of an item's value (a UPR MUTATION or a stored item);
    ``flags`` as the client set them."""

    @property
    def value(self) -> bytes: ...
    @property
    def flags(self) -> int: ...
    @property
    def expiration(self) -> int: ...


class ItemMessages:
    """The item messages of one TAP connection, given its CONNECT's choices."""

    __slots__ = ("keys_only", "network_byte_order", "tap_flags")

    def __init__(self, *, keys_only: bool, network_byte_order: bool) -> None:
        self.keys_only = keys_only
        self.network_byte_order = network_byte_order
        tap_flags = NO_TAP_FLAGS
        if keys_only:
            tap_flags |= TapFlags.NO_VALUE
        if network_byte_order:
            tap_flags |= TapFlags.NETWORK_BYTE_ORDER
        self.tap_flags = TapFlags(tap_flags)
        """The TAP flags of every MUTATION of the connection, before stamping."""

    def mutation(self, item: StoredMutation, vbucket: int, nru: int) -> TapMutation:
        return TapMutation(
            item.key,
            b"" if self.keys_only else item.value,
            vbucket,
            cas=item.cas,
            flags=item.flags if self.network_byte_order else swap32(item.flags),
            expiration=item.expiration,
            rev_seqno=item.rev_seqno,
            nru=nru,
            tap_flags=self.tap_flags,
        )

    @staticmethod
    def deletion(item: StoredRemoval, vbucket: int) -> TapDelete:
        return TapDelete(item.key, vbucket, cas=item.cas, rev_seqno=item.rev_seqno)


def stored_flags(message: TapMutation) -> int:
    """The item flags of ``message`` as the client set them: as they travel with
    NETWORK_BYTE_ORDER, byte-swapped from 2.x's host order without it."""
    flags = message.flags
    return flags if message.tap_flags & TapFlags.NETWORK_BYTE_ORDER else swap32(flags)
