"""Engine-specific bytes of TAP items, read as ep-engine 2.5.1's consumer reads them.

ep-engine 2.5.1 src/ep_engine.cc ``tapNotify``: a MUTATION carries metadata
when its engine-specific data holds at least the 8-byte rev_seqno (the nru
byte is read only when there are exactly 9: tapconnection.cc
``TapEngineSpecific::readSpecificData``); a DELETE only when it holds exactly
8. Any other length is an item without metadata, applied all the same; only
engine-specific bytes running past the body are refused (the key would be
read beyond it).
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp import FrameReader
from adapters.mcbp.frames import encode_frame
from adapters.tap import TapDelete, TapMutation, TapOpcode, decode_frame


def _decode(packet: bytes) -> object:
    reader = FrameReader()
    reader.receive_data(packet)
    frame = reader.next_frame()
    assert frame is not None
    return decode_frame(frame)


def _mutation(es: bytes, key: bytes = b"k", value: bytes = b"v") -> bytes:
    extras = struct.pack(">HHB3xII", len(es), 0, 255, 7, 9) + es
    return encode_frame(0x80, TapOpcode.MUTATION, extras=extras, key=key, value=value,
                        extras_length=16)  # fmt: skip


def _delete(es: bytes, key: bytes = b"k", value: bytes = b"") -> bytes:
    extras = struct.pack(">HHB3x", len(es), 0, 255) + es
    return encode_frame(0x80, TapOpcode.DELETE, extras=extras, key=key, value=value,
                        extras_length=8)  # fmt: skip


@given(st.binary(max_size=40), st.binary(min_size=1, max_size=20), st.binary(max_size=20))
def test_a_mutation_reads_metadata_from_8_bytes_on(es: bytes, key: bytes, value: bytes) -> None:
    event = _decode(_mutation(es, key, value))
    assert isinstance(event, TapMutation)
    assert (event.key, event.value, event.flags, event.expiration) == (key, value, 7, 9)
    if len(es) >= 8:
        assert event.rev_seqno == struct.unpack_from(">Q", es)[0]
        assert event.nru == (es[8] if len(es) == 9 else None)
    else:
        assert (event.rev_seqno, event.nru) == (None, None)


@given(st.binary(max_size=40), st.binary(min_size=1, max_size=20), st.binary(max_size=20))
def test_a_delete_reads_metadata_from_exactly_8_bytes(es: bytes, key: bytes, value: bytes) -> None:
    event = _decode(_delete(es, key, value))
    assert isinstance(event, TapDelete)
    assert event.key == key
    assert event.rev_seqno == (struct.unpack(">Q", es)[0] if len(es) == 8 else None)


@pytest.mark.parametrize("make", [_mutation, _delete])
def test_engine_specific_bytes_past_the_body_are_refused(make: object) -> None:
    packet = bytearray(make(b"\0" * 8))  # type: ignore[operator]
    packet[24:26] = (200).to_bytes(2, "big")
    with pytest.raises(ProtocolError) as info:
        _decode(bytes(packet))
    assert (info.value.field, info.value.value) == ("engine_specific_length", 200)
