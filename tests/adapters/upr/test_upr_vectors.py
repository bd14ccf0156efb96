"""Every UPR packet of the protocol documents decodes to what its breakdown prints.

Vectors come from ``tests/data/seed-packets.json``: the transport draft's
examples (dialect ``upr-draft``) and the released stream-request document's
(dialect ``dcp``). Each is decoded in its own dialect, compared field by
field with the breakdown's numbers, and re-encoded byte for byte. Two
examples have framing errata; their tests show the packet as printed and a
corrected one.
"""

from __future__ import annotations

import pytest

from adapters.errors import ProtocolError
from adapters.mcbp import FrameReader, Status
from adapters.upr import (
    DCP,
    UPR_DRAFT,
    Deletion,
    Dialect,
    Expiration,
    FailoverLogResponse,
    Flush,
    GetFailoverLog,
    Mutation,
    SetVbucketState,
    SnapshotEnd,
    SnapshotStart,
    StreamEnd,
    StreamEndReason,
    StreamFlags,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    StreamStart,
    UprDecoder,
    UprEvent,
    VBucketState,
    decode_frame,
    encode,
)
from tests.support.vectors import patch, vectors

DRAFT_VECTORS = vectors("upr-draft")
DCP_VECTORS = vectors("dcp")

OPAQUE = 0xDEADBEEF  # every transport-draft example
DCP_OPAQUE = 0x1000  # every stream-request-document example
ALL_SEQNOS = 0xFFFFFFFFFFFFFFFF

# The failover log both documents print: (vbucket uuid, seqno), newest first.
FAILOVER_LOG = (
    (0xFEEDDECA, 0x5432),
    (0xDECAFE, 0x1343214),
    (0xFEEDFACE, 0x4),
    (0xDEADBEEF, 0x6524),
)

# upr-transport-spec.md: line of the example -> the event its breakdown describes.
DRAFT_EXPECTED: dict[int, UprEvent] = {
    49: GetFailoverLog(opaque=OPAQUE, vbucket=0),
    81: FailoverLogResponse(failover_log=FAILOVER_LOG, opaque=OPAQUE),
    217: StreamRequest(
        flags=StreamFlags(0),
        start_seqno=0xFFEEDD,
        end_seqno=ALL_SEQNOS,
        vbucket_uuid=0xFEEDDECA,
        high_seqno=0,
        name=b"vbstream-0",
        opaque=OPAQUE,
    ),
    # The draft sends the rollback seqno in the extras (extras length 8).
    278: StreamRequestRollback(rollback_seqno=0, opaque=OPAQUE),
    312: StreamRequest(
        start_seqno=0,
        end_seqno=ALL_SEQNOS,
        vbucket_uuid=0xFEEDDECA,
        high_seqno=0,
        name=b"vbstream-0",
        opaque=OPAQUE,
    ),
    # Success with an empty value: an empty failover log.
    373: StreamRequestOk(failover_log=(), opaque=OPAQUE),
    418: StreamStart(opaque=OPAQUE),
    458: StreamEnd(reason=StreamEndReason.OK, opaque=OPAQUE),
    509: SnapshotStart(opaque=OPAQUE),
    548: SnapshotEnd(opaque=OPAQUE),
    687: Deletion(b"hello", by_seqno=0, rev_seqno=0, cas=1, opaque=OPAQUE),
    755: Expiration(b"hello", by_seqno=0, rev_seqno=0, cas=1, opaque=OPAQUE),
    809: Flush(opaque=OPAQUE),
    # Wire 0x04 is dead in both numberings.
    868: SetVbucketState(VBucketState.DEAD, opaque=OPAQUE),
}

# dcp-stream-request.md.
DCP_EXPECTED: dict[int, UprEvent] = {
    # The breakdown prints snapshot start 0, but the diagram's bytes 56-63 say
    # 0x0000000000ffeedd (= start seqno); the wire bytes are what is asserted.
    60: StreamRequest(
        start_seqno=0xFFEEDD,
        end_seqno=ALL_SEQNOS,
        vbucket_uuid=0xFEEDDECA,
        snap_start_seqno=0xFFEEDD,
        snap_end_seqno=0xFFEEFF,
        opaque=DCP_OPAQUE,
    ),
    # Released servers send the rollback seqno as the value, extras length 0.
    120: StreamRequestRollback(rollback_seqno=0, opaque=DCP_OPAQUE),
    210: StreamRequestOk(failover_log=FAILOVER_LOG, opaque=DCP_OPAQUE),
}

DRAFT_ERRATUM_LINE = 607
DCP_ERRATUM_LINE = 154

CASES = [(UPR_DRAFT, line, event) for line, event in DRAFT_EXPECTED.items()] + [
    (DCP, line, event) for line, event in DCP_EXPECTED.items()
]


def decode_one(packet: bytes, dialect: Dialect) -> UprEvent:
    decoder = UprDecoder(dialect)
    decoder.receive_data(packet)
    events = decoder.events()
    assert len(events) == 1
    assert decoder.buffered == 0
    return events[0]


def test_every_vector_is_covered() -> None:
    assert set(DRAFT_EXPECTED) | {DRAFT_ERRATUM_LINE} == set(DRAFT_VECTORS)
    assert set(DCP_EXPECTED) | {DCP_ERRATUM_LINE} == set(DCP_VECTORS)


@pytest.mark.parametrize(
    ("dialect", "line", "expected"), CASES, ids=[f"{d.name}:{line}" for d, line, _ in CASES]
)
def test_vector_decodes_to_breakdown_and_reencodes(
    dialect: Dialect, line: int, expected: UprEvent
) -> None:
    vector = DRAFT_VECTORS[line] if dialect is UPR_DRAFT else DCP_VECTORS[line]
    assert vector.framing_consistent
    event = decode_one(vector.packet, dialect)
    assert event == expected
    assert encode(event, dialect) == vector.packet


def test_failover_log_numbers_spelled_out() -> None:
    event = decode_one(DRAFT_VECTORS[81].packet, UPR_DRAFT)
    assert isinstance(event, FailoverLogResponse)
    assert event.failover_log == (
        (0xFEEDDECA, 0x5432),
        (0xDECAFE, 0x1343214),
        (0xFEEDFACE, 4),
        (0xDEADBEEF, 0x6524),
    )


# Erratum (upr-transport-spec.md, MUTATION example): the header says total
# body 0x27 (39) but the packet carries 38 bytes: 28 of extras, the 5-byte key
# "hello" and the 5-byte value "world". (The breakdown's value offsets 57-62
# follow the same off-by-one.) As printed, the decoder waits for a byte that
# never comes; with total body 38 it is the breakdown's mutation.
DRAFT_ERRATUM_EVENT = Mutation(
    b"hello",
    b"world",
    by_seqno=0,
    rev_seqno=0,
    flags=0,
    expiration=0,
    lock_time=0,
    cas=1,
    opaque=OPAQUE,
)


def test_draft_mutation_erratum_as_printed_is_incomplete() -> None:
    vector = DRAFT_VECTORS[DRAFT_ERRATUM_LINE]
    assert not vector.framing_consistent
    assert len(vector.packet) == 24 + 38
    decoder = UprDecoder(UPR_DRAFT)
    decoder.receive_data(vector.packet)
    assert decoder.next_event() is None
    assert decoder.buffered == len(vector.packet)


def test_draft_mutation_erratum_corrected_decodes_and_reencodes() -> None:
    corrected = patch(DRAFT_VECTORS[DRAFT_ERRATUM_LINE].packet, 8, (38).to_bytes(4, "big"))
    event = decode_one(corrected, UPR_DRAFT)
    assert event == DRAFT_ERRATUM_EVENT
    assert encode(event, UPR_DRAFT) == corrected


# Erratum (dcp-stream-request.md, the second STREAM_REQ): the diagram stops
# after the snapshot start seqno, so the 8 bytes of snapshot end (which the
# breakdown lists as 0) are missing: total body 0x30 (48), 40 present. As
# printed the packet is incomplete; with the 8 bytes added it is the breakdown.
DCP_ERRATUM_EVENT = StreamRequest(
    start_seqno=0,
    end_seqno=ALL_SEQNOS,
    vbucket_uuid=0xFEEDDECA,
    snap_start_seqno=0,
    snap_end_seqno=0,
    opaque=DCP_OPAQUE,
)


def test_dcp_stream_request_erratum_as_printed_is_incomplete() -> None:
    vector = DCP_VECTORS[DCP_ERRATUM_LINE]
    assert not vector.framing_consistent
    assert len(vector.packet) == 24 + 40
    decoder = UprDecoder(DCP)
    decoder.receive_data(vector.packet)
    assert decoder.next_event() is None
    assert decoder.buffered == len(vector.packet)


def test_dcp_stream_request_erratum_corrected_decodes_and_reencodes() -> None:
    corrected = DCP_VECTORS[DCP_ERRATUM_LINE].packet + bytes(8)
    event = decode_one(corrected, DCP)
    assert event == DCP_ERRATUM_EVENT
    assert encode(event, DCP) == corrected


def test_early_draft_vectors_are_neither_dialect() -> None:
    # upr-protocol-draft.md (opcodes 0x01..0x05 with a sub-type byte) is
    # history, not a wire format: no opcode of it exists in either dialect.
    seen = 0
    for vector in vectors("upr-early-draft").values():
        reader = FrameReader()
        reader.receive_data(vector.packet)
        frame = reader.next_frame()
        if frame is None:  # some examples declare more body than they carry
            continue
        seen += 1
        for dialect in (DCP, UPR_DRAFT):
            with pytest.raises(ProtocolError) as info:
                decode_frame(frame, dialect)
            assert info.value.status == Status.UNKNOWN_COMMAND
    assert seen
