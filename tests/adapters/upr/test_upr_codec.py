"""UPR codec behaviour beyond the documents' examples: layouts, dialects, bad input."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from adapters.errors import LocalProtocolError, ProtocolError
from adapters.fastinit import positional_constructor
from adapters.mcbp import FrameReader, Status, encode_frame
from adapters.upr import (
    DCP,
    REQUEST_CLASSES,
    UPR_DRAFT,
    AddStreamResponse,
    Command,
    Control,
    Deletion,
    Dialect,
    Expiration,
    GetFailoverLog,
    Mutation,
    Open,
    OpenFlags,
    Response,
    SetVbucketState,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    StreamStart,
    UprDecoder,
    UprEvent,
    VBucketState,
    decode_failover_log,
    decode_frame,
    encode,
    encode_failover_log,
    get_dialect,
)
from adapters.upr.responses import FailoverLogResponse

REQ, RES = 0x80, 0x81
INVALID = Status.INVALID_ARGUMENTS
MUTATION_EXTRAS = struct.Struct(">QQIIIHB")


def decode_all(
    data: bytes, dialect: Dialect = DCP, max_frame_size: int = 1 << 20
) -> list[UprEvent]:
    decoder = UprDecoder(dialect, max_frame_size)
    decoder.receive_data(data)
    events = decoder.events()
    assert decoder.buffered == 0
    return events


def decode_error(data: bytes, dialect: Dialect = DCP) -> ProtocolError:
    decoder = UprDecoder(dialect)
    decoder.receive_data(data)
    with pytest.raises(ProtocolError) as info:
        decoder.events()
    return info.value


def frame_of(packet: bytes) -> object:
    reader = FrameReader()
    reader.receive_data(packet)
    return reader.next_frame()


# --- dialect tables ------------------------------------------------------------


def test_get_dialect() -> None:
    assert get_dialect("dcp") is DCP
    assert get_dialect("upr-draft") is UPR_DRAFT
    with pytest.raises(ValueError, match="unknown UPR dialect"):
        get_dialect("tap")


def test_every_event_has_a_name_and_a_direction() -> None:
    names = {
        "OPEN", "ADD_STREAM", "CLOSE_STREAM", "STREAM_REQ", "GET_FAILOVER_LOG", "STREAM_END",
        "SNAPSHOT_MARKER", "MUTATION", "DELETION", "EXPIRATION", "FLUSH", "SET_VBUCKET_STATE",
        "NOOP", "BUFFER_ACKNOWLEDGEMENT", "CONTROL", "STREAM_START", "SNAPSHOT_START",
        "SNAPSHOT_END",
    }  # fmt: skip
    assert set(REQUEST_CLASSES) == set(Command)
    assert {cls.NAME for cls in REQUEST_CLASSES.values()} == names
    for command, cls in REQUEST_CLASSES.items():
        assert command.name == cls.NAME and not cls.IS_RESPONSE
        assert {f.name for f in dataclasses.fields(cls)} >= {"opaque", "vbucket"}
    for response in (StreamRequestOk, StreamRequestRollback, FailoverLogResponse):
        assert response.IS_RESPONSE
    assert StreamRequestRollback().status == Status.ROLLBACK
    assert AddStreamResponse.IS_RESPONSE and Response.IS_RESPONSE


def test_vbucket_states_travel_in_each_dialects_numbering() -> None:
    # Engine order in events; released servers send engine order, the draft
    # numbers pending 2 and replica 3.
    wire = {DCP: {VBucketState.PENDING: 3, VBucketState.REPLICA: 2},
            UPR_DRAFT: {VBucketState.PENDING: 2, VBucketState.REPLICA: 3}}  # fmt: skip
    for dialect, states in wire.items():
        for state, number in states.items():
            packet = encode(SetVbucketState(state, opaque=5, vbucket=9), dialect)
            assert packet[24] == number
            assert decode_all(packet, dialect) == [SetVbucketState(state, 5, 9)]


def test_unknown_vbucket_state_is_invalid() -> None:
    packet = encode_frame(REQ, 0x5B, extras=b"\x05")
    error = decode_error(packet)
    assert (error.field, error.value, error.offset, error.status) == ("state", 5, 24, INVALID)


def test_messages_of_one_dialect_cannot_be_encoded_in_the_other() -> None:
    for event in (Open(b"n"), SnapshotMarker(), Control(b"k"), Response(Command.NOOP)):
        with pytest.raises(LocalProtocolError, match="upr-draft"):
            encode(event, UPR_DRAFT)
    with pytest.raises(LocalProtocolError, match="dcp"):
        encode(StreamStart(), DCP)


def test_opcode_outside_the_dialect_is_unknown_command() -> None:
    # CONTROL (0x5e) exists only in released DCP; 0x00 (GET) is no UPR opcode.
    cases = ((encode(Control(b"k"), DCP), UPR_DRAFT), (encode_frame(REQ, 0), DCP))
    for packet, dialect in cases:
        first = encode(GetFailoverLog(), dialect)
        error = decode_error(first + packet, dialect)
        assert error.status == Status.UNKNOWN_COMMAND
        assert (error.field, error.offset) == ("opcode", len(first) + 1)


# --- items -------------------------------------------------------------------


def test_mutation_metadata_trails_the_value() -> None:
    event = Mutation(
        b"key", b"value", by_seqno=7, rev_seqno=2, flags=0xCAFE, expiration=99, lock_time=3,
        nru=1, meta=b"\x01\x02\x03", cas=55, datatype=1, opaque=4, vbucket=1000,
    )  # fmt: skip
    packet = encode(event)
    assert packet[1] == 0x57 and packet[4] == 31 and packet[5] == 1
    assert MUTATION_EXTRAS.unpack_from(packet, 24) == (7, 2, 0xCAFE, 99, 3, 3, 1)
    assert packet[55:] == b"keyvalue\x01\x02\x03"
    assert decode_all(packet) == [event]


def test_mutation_nmeta_longer_than_the_value_is_invalid() -> None:
    extras = MUTATION_EXTRAS.pack(1, 1, 0, 0, 0, 6, 0)
    error = decode_error(encode_frame(REQ, 0x57, extras=extras, key=b"k", value=b"abc"))
    assert (error.field, error.value, error.offset) == ("nmeta", 6, 24 + 28)


def test_wrong_extras_length_on_mutation_names_opcode_and_field() -> None:
    good = encode(Mutation(b"k", b"v"))
    bad = encode_frame(REQ, 0x57, extras=bytes(30), key=b"k", value=b"v")
    error = decode_error(good + bad)
    assert error.opcode == 0x57
    assert error.field == "extras_length" and error.value == 30
    assert error.status == INVALID
    assert error.offset == len(good) + 4  # absolute stream offset of the extras length
    assert "MUTATION" in str(error) and "31" in str(error) and "opcode=0x57" in str(error)
    # decode_frame alone gives the offset within the packet.
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame_of(bad))  # type: ignore[arg-type]
    assert info.value.offset == 4


def test_draft_mutation_has_28_byte_extras_and_no_metadata() -> None:
    event = Mutation(b"k", b"v", by_seqno=1, rev_seqno=2, flags=3, expiration=4, lock_time=5)
    packet = encode(event, UPR_DRAFT)
    assert packet[1] == 0x56 and packet[4] == 28
    assert decode_all(packet, UPR_DRAFT) == [event]
    for bad in (dataclasses.replace(event, meta=b"m"), dataclasses.replace(event, nru=1)):
        with pytest.raises(LocalProtocolError):
            encode(bad, UPR_DRAFT)
    error = decode_error(encode(event, DCP), UPR_DRAFT)  # 0x57 is DELETION in the draft
    assert error.field == "extras_length"


def test_mutation_without_key_is_invalid() -> None:
    extras = MUTATION_EXTRAS.pack(1, 1, 0, 0, 0, 0, 0)
    error = decode_error(encode_frame(REQ, 0x57, extras=extras, value=b"v"))
    assert (error.field, error.status) == ("key", INVALID)
    with pytest.raises(LocalProtocolError):
        encode(Mutation(b""))


@pytest.mark.parametrize(
    ("event", "extras_length"),
    [
        (Deletion(b"k", by_seqno=5, rev_seqno=6, meta=b"mm", cas=3), 18),
        (Deletion(b"k", by_seqno=5, rev_seqno=6, delete_time=1_400_000_000), 21),
        (Expiration(b"k", by_seqno=5, rev_seqno=6), 18),
        (Expiration(b"k", by_seqno=5, rev_seqno=6, delete_time=1_400_000_000), 20),
    ],
)
def test_deletion_and_expiration_layouts(event: Deletion | Expiration, extras_length: int) -> None:
    packet = encode(event)
    assert packet[4] == extras_length
    assert decode_all(packet) == [event]


def test_deletion_value_between_key_and_metadata_is_kept() -> None:
    event = Deletion(b"k", by_seqno=1, meta=b"MM", value=b"body")
    packet = encode(event)
    assert packet.endswith(b"kbodyMM")
    assert decode_all(packet) == [event]


def test_deletion_extras_error_lists_the_accepted_lengths() -> None:
    error = decode_error(encode_frame(REQ, 0x58, extras=bytes(19), key=b"k"))
    assert "18 or 21" in str(error) and error.field == "extras_length"
    error = decode_error(encode_frame(REQ, 0x59, extras=bytes(21), key=b"k"))
    assert "18 or 20" in str(error)


def test_draft_has_no_delete_time_or_deletion_metadata() -> None:
    for event in (Deletion(b"k", delete_time=1), Expiration(b"k", meta=b"m")):
        with pytest.raises(LocalProtocolError):
            encode(event, UPR_DRAFT)


# --- stream set-up --------------------------------------------------------------


def test_stream_request_fields_belong_to_their_dialect() -> None:
    for event in (StreamRequest(name=b"group"), StreamRequest(high_seqno=5)):
        with pytest.raises(LocalProtocolError):
            encode(event, DCP)
    with pytest.raises(LocalProtocolError):
        encode(StreamRequest(snap_end_seqno=5), UPR_DRAFT)
    # A key on a released STREAM_REQ has no place: malformed.
    error = decode_error(encode_frame(REQ, 0x53, extras=bytes(48), key=b"g"))
    assert (error.field, error.status) == ("key_length", INVALID)


def test_stream_request_ranges_are_not_the_codecs_business() -> None:
    # start > end and start outside the snapshot: a server answers 0x22, the
    # packet itself is well formed.
    event = StreamRequest(start_seqno=10, end_seqno=5, snap_start_seqno=20, snap_end_seqno=1)
    assert decode_all(encode(event)) == [event]


@pytest.mark.parametrize("dialect", [DCP, UPR_DRAFT], ids=["dcp", "upr-draft"])
def test_rollback_seqno_accepted_in_value_and_in_extras(dialect: Dialect) -> None:
    opcode = dialect.opcodes[Command.STREAM_REQ]
    seqno = (0x1234).to_bytes(8, "big")
    in_value = encode_frame(RES, opcode, vbucket_or_status=0x23, opaque=9, value=seqno)
    in_extras = encode_frame(RES, opcode, vbucket_or_status=0x23, opaque=9, extras=seqno)
    expected = StreamRequestRollback(rollback_seqno=0x1234, opaque=9)
    assert decode_all(in_value + in_extras, dialect) == [expected, expected]
    # Each dialect sends it where its servers did.
    assert encode(expected, dialect) == (in_extras if dialect.rollback_in_extras else in_value)


def test_rollback_without_an_8_byte_seqno_is_invalid() -> None:
    packet = encode_frame(RES, 0x53, vbucket_or_status=0x23, value=bytes(4))
    error = decode_error(packet)
    assert (error.field, error.status) == ("rollback_seqno", INVALID)


def test_failed_stream_request_is_a_generic_response() -> None:
    packet = encode_frame(RES, 0x53, vbucket_or_status=0x22, opaque=3, value=b"range")
    assert decode_all(packet) == [Response(Command.STREAM_REQ, 3, 0x22, b"range")]
    # Statuses that have a class of their own cannot be sent generically.
    for status in (0x00, 0x23):
        with pytest.raises(LocalProtocolError):
            encode(Response(Command.STREAM_REQ, status=status))


def test_failover_log_helpers() -> None:
    pairs = ((0xABCDEF012345, 100), (0x1, 0))
    value = encode_failover_log(pairs)
    assert len(value) == 32
    assert decode_failover_log(value, 0x54) == pairs
    with pytest.raises(ProtocolError) as info:
        decode_failover_log(value[:-1], 0x54)
    assert (info.value.field, info.value.value, info.value.opcode) == ("failover_log", 31, 0x54)


def test_failover_log_of_odd_length_is_invalid() -> None:
    packet = encode_frame(RES, 0x54, opaque=1, value=bytes(20))
    error = decode_error(packet)
    assert (error.field, error.offset, error.status) == ("failover_log", 24, INVALID)
    # An error status carries no log: a generic response.
    failed = encode_frame(RES, 0x54, vbucket_or_status=0x07, value=b"nmvb")
    assert decode_all(failed) == [Response(Command.GET_FAILOVER_LOG, 0, 0x07, b"nmvb")]


def test_add_stream_response_carries_the_stream_opaque() -> None:
    ok = AddStreamResponse(stream_opaque=0x77, opaque=5)
    refused = AddStreamResponse(stream_opaque=0x78, opaque=6, status=0x02)
    assert decode_all(encode(ok) + encode(refused)) == [ok, refused]
    bare = encode_frame(RES, 0x51, vbucket_or_status=0x04, opaque=7)
    assert decode_all(bare) == [Response(Command.ADD_STREAM, 7, 0x04)]
    error = decode_error(encode_frame(RES, 0x51, opaque=7))
    assert error.field == "extras_length"


def test_open_needs_a_name_and_keeps_flags() -> None:
    event = Open(b"replication:1", OpenFlags.PRODUCER | OpenFlags.INCLUDE_XATTRS, opaque=1)
    packet = encode(event)
    assert packet[4] == 8 and packet[24:32] == bytes.fromhex("0000000000000005")
    assert decode_all(packet) == [event]
    error = decode_error(encode_frame(REQ, 0x50, extras=bytes(8)))
    assert (error.field, error.offset) == ("name", 2)
    with pytest.raises(LocalProtocolError):
        encode(Open(b""))


def test_control_key_must_not_be_empty_and_value_passes_through() -> None:
    event = Control(b"connection_buffer_size", b"1048576\x00")
    assert decode_all(encode(event)) == [event]
    error = decode_error(encode_frame(REQ, 0x5E, value=b"true"))
    assert error.field == "key"


def test_stream_end_keeps_unknown_reasons() -> None:
    event = StreamEnd(reason=42, opaque=3, vbucket=4)
    (decoded,) = decode_all(encode(event))
    assert decoded == event
    assert type(decoded.reason) is int  # type: ignore[union-attr]
    (known,) = decode_all(encode(StreamEnd(StreamEndReason.TOO_SLOW)))
    assert known.reason is StreamEndReason.TOO_SLOW  # type: ignore[union-attr]


def test_snapshot_marker_flags() -> None:
    event = SnapshotMarker(1, 9, SnapshotFlags.MEMORY | SnapshotFlags.CHECKPOINT, opaque=2)
    packet = encode(event)
    assert packet[4] == 20 and packet[-4:] == b"\x00\x00\x00\x05"
    assert decode_all(packet) == [event]


def test_unexpected_body_parts_are_invalid() -> None:
    cases = [
        (encode_frame(REQ, 0x5A, value=b"x"), "value", 24),  # FLUSH with a value
        (encode_frame(REQ, 0x5C, extras=b"abcd"), "extras_length", 4),  # NOOP with extras
        (encode_frame(REQ, 0x55, extras=bytes(4), key=b"k"), "key_length", 2),  # STREAM_END
        (encode_frame(RES, 0x5C, extras=b"e"), "extras_length", 4),  # NOOP response
    ]
    for packet, field, offset in cases:
        error = decode_error(packet)
        assert (error.field, error.offset, error.status) == (field, offset, INVALID)


# --- framing --------------------------------------------------------------------


def test_body_over_the_frame_limit_is_rejected_from_the_header() -> None:
    first = encode(Mutation(b"k", b"v"))
    header = encode_frame(REQ, 0x57, extras=bytes(31), key=b"k", value=b"x" * 2000)[:24]
    decoder = UprDecoder(DCP, max_frame_size=1024)
    decoder.receive_data(first + header)  # the header alone, no body yet
    assert decoder.next_event() == Mutation(b"k", b"v")
    with pytest.raises(ProtocolError) as info:
        decoder.next_event()
    assert info.value.field == "total_body"
    assert info.value.offset == len(first) + 8


def test_events_come_out_as_bytes_arrive() -> None:
    packets = [encode(Mutation(b"a", b"1", by_seqno=1)), encode(StreamEnd(opaque=2))]
    stream = b"".join(packets)
    decoder = UprDecoder()
    out: list[UprEvent] = []
    for i in range(len(stream)):
        decoder.receive_data(stream[i : i + 1])
        out.extend(decoder.events())
        if i == len(packets[0]) - 2:
            assert out == [] and decoder.consumed == 0
    assert out == [Mutation(b"a", b"1", by_seqno=1), StreamEnd(opaque=2)]
    assert decoder.consumed == len(stream)


def test_struct_overflow_is_a_local_protocol_error() -> None:
    too_big: list[UprEvent] = [
        Mutation(b"k", by_seqno=-1),
        StreamEnd(reason=1 << 32),
        Response(Command.NOOP, status=1 << 16),
        Control(b"k" * 70_000),
    ]
    for event in too_big:
        with pytest.raises(LocalProtocolError):
            encode(event)


def test_positional_constructor_matches_the_dataclass() -> None:
    make = positional_constructor(Mutation)
    args = (b"k", b"v", 1, 2, 3, 4, 5, 6, b"m", 7, 8, 9, 10)
    built = make(*args)
    assert built == Mutation(*args) and type(built) is Mutation
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.key = b"x"  # type: ignore[misc]
