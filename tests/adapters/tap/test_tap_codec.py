"""TAP codec behaviour beyond the documents' examples: metadata, acks, bad input."""

from __future__ import annotations

import struct

import pytest

from adapters.errors import ProtocolError
from adapters.mcbp import DEFAULT_MAX_FRAME_SIZE, Status, encode_frame
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapConnect,
    TapDecoder,
    TapDelete,
    TapFlags,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapOpcode,
    TapResponse,
    encode,
)


def decode_all(data: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> list[object]:
    decoder = TapDecoder(max_frame_size)
    decoder.receive_data(data)
    return list(decoder.events())


def test_mutation_with_2x_metadata() -> None:
    event = TapMutation(
        b"k",
        b"v" * 10,
        vbucket=5,
        opaque=77,
        cas=99,
        flags=0xDEADBEEF,
        expiration=1234,
        rev_seqno=42,
        nru=2,
        tap_flags=TapFlags.ACK | TapFlags.NETWORK_BYTE_ORDER,
        ttl=254,
    )
    packet = encode(event)
    # Engine-specific length 9: rev_seqno u64 + nru u8, between extras and key.
    assert struct.unpack_from(">H", packet, 24)[0] == 9
    assert packet[4] == 16
    assert packet[40:49] == struct.pack(">QB", 42, 2)
    assert decode_all(packet) == [event]


def test_keys_only_mutation_has_no_value() -> None:
    event = TapMutation(b"key", tap_flags=TapFlags.NO_VALUE, rev_seqno=1)
    assert decode_all(encode(event)) == [event]


def test_delete_with_rev_seqno_and_trailing_value_ignored() -> None:
    event = TapDelete(b"gone", vbucket=1, rev_seqno=8)
    packet = encode(event)
    # A server that sends the deleted item's value after the key: still the same delete.
    longer = bytearray(packet + b"old-value")
    struct.pack_into(">I", longer, 8, len(packet) - 24 + 9)
    assert decode_all(bytes(longer)) == [event]


def test_connect_with_every_option() -> None:
    flags = (
        ConnectFlags.BACKFILL
        | ConnectFlags.LIST_VBUCKETS
        | ConnectFlags.CHECKPOINT
        | ConnectFlags.REGISTERED_CLIENT
        | ConnectFlags.SUPPORT_ACK
    )
    event = TapConnect(
        b"replica-1",
        flags,
        backfill_date=0,
        vbuckets=(1, 2),
        checkpoints=((1, 10), (2, 20)),
        registered_byte=1,
    )
    packet = encode(event)
    value = packet[24 + 4 + len(b"replica-1") :]
    assert value == (
        struct.pack(">Q", 0)
        + struct.pack(">HHH", 2, 1, 2)
        + struct.pack(">HHQHQ", 2, 1, 10, 2, 20)
        + b"\x01"
    )
    assert decode_all(packet) == [event]


def test_connect_without_extras_means_no_flags() -> None:
    packet = encode_frame(0x80, TapOpcode.CONNECT, key=b"plain")
    assert decode_all(packet) == [TapConnect(b"plain")]


@pytest.mark.parametrize(
    ("flags", "value", "field"),
    [
        (ConnectFlags.BACKFILL, b"\x00" * 4, "backfill_date"),
        (ConnectFlags.LIST_VBUCKETS, b"\x00\x03\x00\x01", "vbuckets"),
        (ConnectFlags.LIST_VBUCKETS, b"\x00", "vbuckets"),
        (ConnectFlags.CHECKPOINT, b"\x00\x01\x00\x01", "checkpoints"),
    ],
)
def test_malformed_connect_body_names_the_field(
    flags: ConnectFlags, value: bytes, field: str
) -> None:
    packet = encode_frame(0x80, 0x40, extras=struct.pack(">I", flags), key=b"n", value=value)
    with pytest.raises(ProtocolError) as info:
        decode_all(packet)
    assert info.value.field == field
    assert info.value.status == Status.NOT_SUPPORTED
    assert info.value.opcode == 0x40
    assert "CONNECT" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # CHECKPOINT with no map at all (not even its count).
        ("8040000404000000000000080000000100000000000000000000004063703031", TapConnect(
            b"cp01", ConnectFlags.CHECKPOINT, opaque=1)),
        # CHECKPOINT | REGISTERED_CLIENT and one byte: the byte is the registered one.
        ("804000040400000000000009000000020000000000000000000000c072656731" + "01",
         TapConnect(b"reg1", ConnectFlags.CHECKPOINT | ConnectFlags.REGISTERED_CLIENT,
                    registered_byte=1, opaque=2)),
        # LIST_VBUCKETS with a count of 0 (every vbucket).
        ("80400004040000000000000a0000000300000000000000000000000476626c30" + "0000",
         TapConnect(b"vbl0", ConnectFlags.LIST_VBUCKETS, opaque=3)),
        # SUPPORT_ACK and a flag 2.x did not know, with data after the known options.
        ("80400004040000000000000c00000004000000000000000000000210756e6b6e" + "deadbeef",
         TapConnect(b"unkn", ConnectFlags(0x210), opaque=4)),
    ],
)  # fmt: skip
def test_connects_as_ep_engine_2x_read_them(raw: str, expected: TapConnect) -> None:
    """ep-engine 2.x ep_engine.cc ``createTapQueue``: the checkpoint map is read
    only if its count is there, LIST_VBUCKETS may list none, unknown flag bits
    and bytes after the known options are ignored."""
    assert decode_all(bytes.fromhex(raw)) == [expected]


def test_classic_2x_client_acks_decode() -> None:
    """The acks ``mc_bin_server.MemcachedBinaryChannel.handle_read`` sends: the
    request's opcode, key length and opaque, extras length from EXTRA_HDR_SIZES
    (16 mutation, 8 other TAP messages, 0 checkpoints), body empty; memcached
    2.x (daemon/memcached.c, ``process_bin_tap_ack``) takes opaque and status."""
    acks = [
        (TapOpcode.MUTATION, 9, 16, 100),
        (TapOpcode.DELETE, 9, 8, 101),
        (TapOpcode.OPAQUE, 0, 8, 102),
        (TapOpcode.VBUCKET_SET, 0, 8, 103),
        (TapOpcode.CHECKPOINT_START, 16, 0, 104),
        (TapOpcode.CHECKPOINT_END, 14, 0, 105),
    ]
    data = b"".join(
        struct.pack(">BBHBBHIIQ", 0x81, op, keylen, extlen, 0, 0, 0, opaque, 0)
        for op, keylen, extlen, opaque in acks
    )
    assert decode_all(data) == [TapResponse(op, opaque) for op, _, _, opaque in acks]


def test_opaque_close_stream_with_header_in_the_value() -> None:
    # One orchestrator sent CLOSE_TAP_STREAM with extras length 0 and the TAP
    # header as the value; parsing by offsets still finds the code.
    body = struct.pack(">HHB3xI", 4, TapFlags.ACK, 255, OpaqueCode.CLOSE_TAP_STREAM)
    packet = encode_frame(0x80, TapOpcode.OPAQUE, opaque=5, value=body)
    assert decode_all(packet) == [
        TapOpaque(OpaqueCode.CLOSE_TAP_STREAM, opaque=5, tap_flags=TapFlags.ACK)
    ]


def test_an_opaque_of_another_engine_specific_length_decodes_for_the_consumer() -> None:
    # 2.5.1 ep_engine.cc ``tapNotify`` logs such an OPAQUE and goes on, so the codec
    # refuses none: the length travels in the event and the consumer decides.
    header_only = struct.pack(">HHB3x", 0, TapFlags.ACK, 255)
    wide = struct.pack(">HHB3xI4x", 8, 0, 255, OpaqueCode.INITIAL_VBUCKET_STREAM)
    packets = [
        encode_frame(0x80, TapOpcode.OPAQUE, opaque=5, extras=header_only),
        encode_frame(0x80, TapOpcode.OPAQUE, opaque=6, extras=wide[:8], value=wide[8:]),
    ]
    assert decode_all(b"".join(packets)) == [
        TapOpaque(0, opaque=5, tap_flags=TapFlags.ACK, engine_specific_length=0),
        TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, opaque=6, engine_specific_length=8),
    ]
    # With 4, the code must be there.
    short = encode_frame(0x80, TapOpcode.OPAQUE, extras=struct.pack(">HHB3x", 4, 0, 255))
    with pytest.raises(ProtocolError):
        decode_all(short)


def test_acks_nacks_and_noops() -> None:
    events = [
        TapResponse(TapOpcode.MUTATION, opaque=1000),
        TapResponse(TapOpcode.CHECKPOINT_END, opaque=7, status=Status.BUSY, text=b"slow down"),
        TapResponse(TapOpcode.CONNECT, status=Status.NOT_SUPPORTED, text=b"bad connect"),
        TapNoop(opaque=3),
        TapNoopResponse(opaque=3),
    ]
    data = b"".join(encode(e) for e in events)
    decoded = decode_all(data)
    assert decoded == events
    assert decoded[0].is_ack and not decoded[1].is_ack  # type: ignore[union-attr]


def test_unknown_opcode_is_unknown_command() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_all(encode_frame(0x80, 0x99))
    assert info.value.status == Status.UNKNOWN_COMMAND
    assert info.value.opcode == 0x99


def test_oversized_frame_rejected_from_the_header_alone() -> None:
    header = struct.pack(">BBHBBHIIQ", 0x80, 0x41, 0, 16, 0, 0, 1 << 30, 0, 0)
    with pytest.raises(ProtocolError) as info:
        decode_all(header, max_frame_size=1 << 20)
    assert info.value.field == "total_body"
    assert info.value.value == 1 << 30


def test_error_offset_is_absolute_in_the_stream() -> None:
    good = encode(TapNoop())
    bad = encode_frame(0x80, TapOpcode.VBUCKET_SET, extras=struct.pack(">HHB3xI", 4, 0, 255, 9))
    decoder = TapDecoder()
    decoder.receive_data(good + good + bad)
    assert decoder.next_event() == TapNoop()
    assert decoder.next_event() == TapNoop()
    with pytest.raises(ProtocolError) as info:
        decoder.next_event()
    assert info.value.field == "state"
    assert info.value.value == 9
    assert info.value.offset == 2 * len(good) + 24 + 8


# Lengths that run past the body: any shorter one is read as 2.5.1 reads it
# (test_tap_codec_conform.py).
@pytest.mark.parametrize("es_len", [11, 200, 65535])
def test_bad_engine_specific_length(es_len: int) -> None:
    extras = struct.pack(">HHB3xII", es_len, 0, 255, 0, 0) + b"\x00" * min(es_len, 10)
    packet = encode_frame(0x80, 0x41, extras=extras, key=b"k", extras_length=16)
    with pytest.raises(ProtocolError) as info:
        decode_all(packet)
    assert info.value.field == "engine_specific_length"
