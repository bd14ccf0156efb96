"""The memcached binary frame reader."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp import HEADER_SIZE, FrameReader, encode_frame


def test_frame_fields_and_slices() -> None:
    packet = encode_frame(
        0x80,
        0x57,
        vbucket_or_status=7,
        opaque=0xABCD,
        cas=9,
        extras=b"E" * 4,
        key=b"key",
        value=b"value",
        datatype=1,
    )
    reader = FrameReader()
    reader.receive_data(packet)
    frame = reader.next_frame()
    assert frame is not None
    assert (frame.magic, frame.opcode, frame.vbucket_or_status, frame.opaque, frame.cas) == (
        0x80,
        0x57,
        7,
        0xABCD,
        9,
    )
    assert (frame.extras, frame.key, frame.value, frame.datatype) == (b"EEEE", b"key", b"value", 1)
    assert frame.size == len(packet) == HEADER_SIZE + 12
    assert frame.is_request
    assert reader.next_frame() is None
    assert reader.consumed == len(packet)


def test_partial_header_and_body_need_more_data() -> None:
    packet = encode_frame(0x81, 0x0A, value=b"x" * 100)
    reader = FrameReader()
    for i in range(len(packet) - 1):
        reader.receive_data(packet[i : i + 1])
        assert reader.next_frame() is None
    reader.receive_data(packet[-1:])
    assert reader.next_frame() is not None


@pytest.mark.parametrize("magic", [0x00, 0x7F, 0x82, 0xFF])
def test_bad_magic(magic: int) -> None:
    reader = FrameReader()
    reader.receive_data(bytes([magic]) + bytes(23))
    with pytest.raises(ProtocolError, match="bad magic") as info:
        reader.next_frame()
    assert info.value.field == "magic"
    assert info.value.offset == 0


def test_extras_and_key_longer_than_body() -> None:
    reader = FrameReader()
    reader.receive_data(struct.pack(">BBHBBHIIQ", 0x80, 0x41, 10, 8, 0, 0, 12, 0, 0))
    with pytest.raises(ProtocolError, match="longer than the total body"):
        reader.next_frame()


def test_a_lenient_reader_frames_responses_by_body_length_and_requests_strictly() -> None:
    """memcached 2.x daemon/memcached.c: ``try_read_command`` and
    ``dispatch_bin_command`` read ``bodylen`` bytes for a TAP response and never
    compare key and extras lengths with it. The classic 2.x client
    (``mc_bin_server.MemcachedBinaryChannel.handle_read``) acks a mutation with
    the request's key length and extras length 16 over an empty body."""
    ack = struct.pack(">BBHBBHIIQ", 0x81, 0x41, 10, 16, 0, 0, 0, 77, 0)
    nack = struct.pack(">BBHBBHIIQ", 0x81, 0x42, 10, 8, 0, 0x85, 4, 78, 0) + b"busy"
    reader = FrameReader(lenient_responses=True)
    reader.receive_data(ack + nack)
    first, second = reader.frames()
    assert (first.opcode, first.opaque, first.body, first.key, first.extras) == (
        0x41, 77, b"", b"", b"",
    )  # fmt: skip
    assert (second.vbucket_or_status, second.opaque, second.value) == (0x85, 78, b"busy")
    assert reader.consumed == len(ack + nack)
    reader.receive_data(struct.pack(">BBHBBHIIQ", 0x80, 0x41, 10, 16, 0, 0, 0, 79, 0))
    with pytest.raises(ProtocolError, match="longer than the total body"):
        reader.next_frame()  # a request whose key and extras overrun its body: refused
    strict = FrameReader()
    strict.receive_data(ack)
    with pytest.raises(ProtocolError, match="longer than the total body"):
        strict.next_frame()


headers = st.tuples(
    st.sampled_from([0x80, 0x81]),
    st.integers(0, 0xFF),
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFF),
    st.binary(max_size=40),
)


@given(st.lists(headers, max_size=12), st.integers(1, 64))
def test_lenient_responses_keep_every_frame_boundary(
    packets: list[tuple[int, int, int, int, bytes]], chunk: int
) -> None:
    """Any key and extras lengths on a response: the frames, their bodies and the
    bytes after them come out unchanged; a request that overruns is refused."""
    stream = b"".join(
        struct.pack(">BBHBBHIIQ", magic, op, keylen, extlen, 0, 0, len(body), n, 0) + body
        for n, (magic, op, keylen, extlen, body) in enumerate(packets)
    )
    reader = FrameReader(lenient_responses=True)
    got: list[tuple[int, bytes, bytes, bytes, bytes]] = []
    refused = None
    for i in range(0, len(stream), chunk):
        reader.receive_data(stream[i : i + chunk])
        try:
            while (f := reader.next_frame()) is not None:
                got.append((f.opaque, f.body, f.extras, f.key, f.value))
        except ProtocolError as exc:
            refused = exc
            break
    bad = next(
        (n for n, (m, _, k, e, body) in enumerate(packets) if m == 0x80 and k + e > len(body)),
        None,
    )
    assert [g[0] for g in got] == list(range(len(packets) if bad is None else bad))
    assert (refused is None) == (bad is None)
    for (_, body, extras, key, value), (magic, _, keylen, extlen, sent) in zip(
        got, packets, strict=False
    ):
        assert body == sent
        if keylen + extlen <= len(sent):
            assert (extras, key, value) == (sent[:extlen], sent[extlen : extlen + keylen],
                                            sent[extlen + keylen :])  # fmt: skip
        else:
            assert magic == 0x81 and (extras, key, value) == (b"", b"", sent)


def test_limit_is_checked_before_buffering_the_body() -> None:
    reader = FrameReader(max_frame_size=1000)
    reader.receive_data(encode_frame(0x80, 1, value=b"v" * 1000))
    assert reader.next_frame() is not None
    reader.receive_data(struct.pack(">BBHBBHIIQ", 0x80, 1, 0, 0, 0, 0, 1001, 0, 0))
    with pytest.raises(ProtocolError, match="frame limit") as info:
        reader.next_frame()
    assert info.value.offset == HEADER_SIZE + 1000 + 8


@given(
    st.lists(
        st.tuples(st.binary(max_size=20), st.binary(max_size=20), st.binary(max_size=50)),
        max_size=10,
    ),
    st.integers(1, 64),
)
def test_any_chunk_size_gives_the_same_frames(
    parts: list[tuple[bytes, bytes, bytes]], chunk: int
) -> None:
    stream = b"".join(encode_frame(0x80, 1, extras=e, key=k, value=v) for e, k, v in parts)
    reader = FrameReader()
    got = []
    for i in range(0, len(stream), chunk):
        reader.receive_data(stream[i : i + chunk])
        got.extend((f.extras, f.key, f.value) for f in reader.frames())
    assert got == parts
    assert reader.buffered == 0
