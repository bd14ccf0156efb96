"""A TAP MUTATION carries datatype 0, whatever datatype the item has.

2.5.1 producers never set it: memcached 2.5 ``daemon/memcached.c``
``ship_tap_log`` zeroes the whole TAP header (``memset(&msg, 0, ...)``) and
sets magic, opcode, lengths, vbucket, opaque and CAS only. 2.5.1 receivers
never read it: ``process_bin_tap_packet`` hands ep-engine's ``tapNotify``
flags, expiration, CAS and the bodies, no datatype (there is no TAP packet
validator in ``setup_bin_packet_handlers`` either); ep-engine 3.0
``ep_engine.cc`` ``EventuallyPersistentEngine::tapNotify`` recomputes it
from the value (``checkUTF8JSON``) unless the connection negotiated
datatypes with HELLO, which no 2.x TAP client does. So a 3.0 upstream's
JSON datatype (1) copied into the header reaches no ep-engine, and only
confuses a client that checks the byte: every path sends 0, as 2.5.1 did.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.tap import encode
from adapters.tap.item_messages import ItemMessages
from adapters.tap.producer import TapProducer
from adapters.translate.upr_to_tap import UprToTap
from adapters.translate.upr_to_tap_fast import item_from_frame, mutation_frame, translate_items
from adapters.upr import SnapshotFlags

DATATYPE_AT = 5  # the header byte after magic, opcode, key length and extras length
VB = 3
OPAQUE = 44


def json_mutation(datatype: int, seqno: int = 1) -> upr.Mutation:
    return upr.Mutation(
        b"doc",
        b'{"a": 1}',
        by_seqno=seqno,
        rev_seqno=2,
        cas=9,
        datatype=datatype,
        vbucket=VB,
        opaque=OPAQUE,
    )


def open_translator(keys_only: bool) -> UprToTap:
    translator = UprToTap(VB, backfill=False, keys_only=keys_only)
    translator.feed(upr.SnapshotMarker(1, 10, SnapshotFlags.MEMORY, vbucket=VB))
    return translator


datatypes = st.integers(1, 255)


@given(datatypes, st.booleans())
def test_event_path_sends_datatype_zero(datatype: int, keys_only: bool) -> None:
    (message,) = open_translator(keys_only).feed(json_mutation(datatype))
    assert encode(message)[DATATYPE_AT] == 0


@given(datatypes, st.booleans())
def test_fast_paths_send_datatype_zero(datatype: int, keys_only: bool) -> None:
    item = json_mutation(datatype)
    producer = TapProducer(support_ack=False)
    assert mutation_frame(item, open_translator(keys_only), 1, 0)[DATATYPE_AT] == 0

    reader = FrameReader()
    reader.receive_data(upr.encode(item))
    frame = reader.next_frame()
    assert frame is not None and frame.datatype == datatype
    done = item_from_frame(frame, open_translator(keys_only), producer)
    assert done is not None and done[0][DATATYPE_AT] == 0

    out: list[bytes] = []
    wire = upr.encode(item)
    translator = open_translator(keys_only)
    translate_items(wire, 0, {OPAQUE: translator}, producer, out, {})
    assert len(out) == 1 and out[0][DATATYPE_AT] == 0


@given(datatypes)
def test_node_sends_datatype_zero(datatype: int) -> None:
    """The reference node's TAP producer builds its messages with the same builder."""
    message = ItemMessages(keys_only=False, network_byte_order=False).mutation(
        json_mutation(datatype), VB, 0
    )
    assert encode(message)[DATATYPE_AT] == 0
