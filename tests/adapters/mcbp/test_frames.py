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
