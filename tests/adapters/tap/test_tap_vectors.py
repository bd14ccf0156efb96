"""Every TAP packet of tap-protocol.txt decodes to what its breakdown prints."""

from __future__ import annotations

import pytest

from adapters.errors import ProtocolError
from adapters.tap import (
    CheckpointLayout,
    ConnectFlags,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapConnect,
    TapDecoder,
    TapDelete,
    TapFlags,
    TapFlush,
    TapMutation,
    TapOpaque,
    TapVbucketSet,
    encode,
)
from adapters.tap.constants import VBucketState
from tests.support.vectors import patch, vectors

TAP = vectors("tap")
CF = ConnectFlags

# Line of the document -> the event its breakdown describes.
EXPECTED = {
    56: TapConnect(b"node1", CF(0)),
    105: TapConnect(b"node1", CF.BACKFILL, backfill_date=0xFFFFFFFFFFFFFFFF),
    154: TapConnect(b"node1", CF.DUMP),
    198: TapConnect(b"node1", CF.LIST_VBUCKETS, vbuckets=(0, 1, 2)),
    251: TapConnect(b"node1", CF.LIST_VBUCKETS | CF.TAKEOVER_VBUCKETS, vbuckets=(0, 1, 2)),
    304: TapConnect(b"node1", CF.SUPPORT_ACK),
    348: TapConnect(b"node1", CF.KEYS_ONLY),
    394: TapConnect(b"node1", CF.REGISTERED_CLIENT),
    436: TapConnect(
        b"node1",
        CF.BACKFILL | CF.LIST_VBUCKETS | CF.SUPPORT_ACK | CF.KEYS_ONLY,
        backfill_date=5,
        vbuckets=(0, 1, 2, 3, 4),
    ),
    504: TapMutation(b"mykey", b"value", vbucket=102, cas=3, ttl=255),
    562: TapDelete(b"mykey", vbucket=102, ttl=255),
    611: TapFlush(ttl=255),
    # The example's engine-specific code is 0xffffffff, no named code: kept as an int.
    655: TapOpaque(0xFFFFFFFF, vbucket=1023, ttl=255),
    713: TapVbucketSet(VBucketState.PENDING, vbucket=56, opaque=57, tap_flags=TapFlags.ACK),
}


def decode_one(packet: bytes) -> object:
    decoder = TapDecoder()
    decoder.receive_data(packet)
    events = decoder.events()
    assert len(events) == 1
    assert decoder.buffered == 0
    return events[0]


def test_every_tap_vector_is_covered() -> None:
    assert set(EXPECTED) | {759, 807} == set(TAP)


@pytest.mark.parametrize("line", sorted(EXPECTED))
def test_vector_decodes_to_breakdown_and_reencodes(line: int) -> None:
    vector = TAP[line]
    assert vector.framing_consistent
    event = decode_one(vector.packet)
    assert event == EXPECTED[line]
    assert encode(event) == vector.packet  # type: ignore[arg-type]


# Erratum: the CHECKPOINT_START/END examples declare a total body of 12
# (0x0c) but carry 16 bytes: the TAP header (whose engine-specific length
# says 4 although no such bytes follow) and an 8-byte checkpoint id. The END
# example's breakdown also names opcode 0x46; its bytes say 0x47.
CHECKPOINT_ERRATA = {
    759: (TapCheckpointStart, 255),
    807: (TapCheckpointEnd, 250),
}


@pytest.mark.parametrize("line", sorted(CHECKPOINT_ERRATA))
def test_checkpoint_erratum_as_printed_is_rejected(line: int) -> None:
    vector = TAP[line]
    assert not vector.framing_consistent
    decoder = TapDecoder()
    decoder.receive_data(vector.packet)
    with pytest.raises(ProtocolError) as info:
        decoder.events()
    assert info.value.field == "total_body"
    assert info.value.opcode == vector.packet[1]


@pytest.mark.parametrize("line", sorted(CHECKPOINT_ERRATA))
def test_checkpoint_erratum_corrected_decodes(line: int) -> None:
    cls, checkpoint_id = CHECKPOINT_ERRATA[line]
    vector = TAP[line]
    corrected = patch(vector.packet, 8, (16).to_bytes(4, "big"))
    event = decode_one(corrected)
    assert event == cls(
        checkpoint_id,
        vbucket=56,
        opaque=57,
        tap_flags=TapFlags.ACK,
        layout=CheckpointLayout.DOCUMENT,
    )
    # Re-encoded, the engine-specific length says 0: no such bytes travel.
    canonical = patch(corrected, 24, (0).to_bytes(2, "big"))
    assert encode(event) == canonical  # type: ignore[arg-type]
    assert decode_one(canonical) == event


def test_checkpoint_server_layout() -> None:
    # What a 2.x server sends: the mutation layout, key "checkpoint_start", id as value.
    event = TapCheckpointStart(7, vbucket=3, opaque=9, tap_flags=TapFlags.ACK)
    packet = encode(event)
    assert packet[1] == 0x46
    assert packet[4] == 16  # extras: TAP header + item flags + expiration
    assert b"checkpoint_start" in packet
    assert packet.endswith((7).to_bytes(8, "big"))
    assert decode_one(packet) == event
    end = TapCheckpointEnd(7, vbucket=3, engine_specific=b"\x00" * 8)
    assert b"checkpoint_end" in encode(end)
    assert decode_one(encode(end)) == end
