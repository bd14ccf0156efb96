"""The node's TAP producer and the TAP front build the same bytes for one item.

Both go through ``adapters.tap.item_messages`` (ep-engine 2.x's
src/tapconnection.cc: keys-only drops the value, flags travel byte-swapped
unless the client asked for network order, a deletion or an expiration is a
DELETE): a stored item and the UPR item a node streams for it encode alike.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from adapters import upr
from adapters.tap import TapDelete, TapFlags, TapMutation, encode
from adapters.tap.constants import swap32
from adapters.tap.item_messages import ItemMessages
from adapters.translate.upr_to_tap import UprToTap
from gateway.node.items import Item, ItemKind
from gateway.node.tap_producer import INITIAL_NRU, item_message

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, 2**64 - 1)
seqnos = st.integers(1, 2**63 - 1)


@st.composite
def items(draw: st.DrawFn) -> Item:
    return Item(
        key=draw(st.binary(min_size=1, max_size=40)),
        value=draw(st.binary(max_size=200)),
        vbucket=draw(st.integers(0, 1023)),
        by_seqno=draw(seqnos),
        rev_seqno=draw(seqnos),
        cas=draw(u64),
        flags=draw(u32),
        expiration=draw(u32),
        datatype=draw(st.integers(0, 7)),
        kind=draw(st.sampled_from(list(ItemKind))),
    )


def as_upr(item: Item) -> upr.Mutation | upr.Deletion | upr.Expiration:
    """The UPR message a node streams for ``item``."""
    if item.kind == ItemKind.MUTATION:
        return upr.Mutation(
            item.key,
            item.value,
            by_seqno=item.by_seqno,
            rev_seqno=item.rev_seqno,
            flags=item.flags,
            expiration=item.expiration,
            nru=INITIAL_NRU,
            cas=item.cas,
            datatype=item.datatype,
            vbucket=item.vbucket,
        )
    kind = upr.Deletion if item.kind == ItemKind.DELETION else upr.Expiration
    return kind(
        item.key,
        by_seqno=item.by_seqno,
        rev_seqno=item.rev_seqno,
        cas=item.cas,
        vbucket=item.vbucket,
    )


@given(items(), st.booleans(), st.booleans())
def test_node_and_front_encode_an_item_alike(item: Item, keys_only: bool, network: bool) -> None:
    node = item_message(ItemMessages(keys_only=keys_only, network_byte_order=network), item)
    translator = UprToTap(
        item.vbucket, backfill=False, keys_only=keys_only, network_byte_order=network
    )
    (front,) = translator.feed(as_upr(item))
    assert encode(node) == encode(front)


@given(items(), st.booleans(), st.booleans())
def test_item_message_fields(item: Item, keys_only: bool, network: bool) -> None:
    message = item_message(ItemMessages(keys_only=keys_only, network_byte_order=network), item)
    if item.deleted:
        assert message == TapDelete(item.key, item.vbucket, cas=item.cas, rev_seqno=item.rev_seqno)
        return
    assert isinstance(message, TapMutation)
    assert message.value == (b"" if keys_only else item.value)
    assert message.flags == (item.flags if network else swap32(item.flags))
    assert bool(message.tap_flags & TapFlags.NO_VALUE) is keys_only
    assert bool(message.tap_flags & TapFlags.NETWORK_BYTE_ORDER) is network
    assert message.nru == INITIAL_NRU
