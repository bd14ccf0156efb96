"""VBUCKET_SET's state is exactly 4 engine-specific bytes, as 2.x read it.

ep-engine 2.x src/ep_engine.cc ``EventuallyPersistentEngine::tapNotify``,
case TAP_VBUCKET_SET: ``nengine != sizeof(vbucket_state_t)`` is "Received
TAP_VBUCKET_SET with illegal size. Force disconnect" (memcached's
``process_bin_tap_packet`` takes ``nengine`` from the TAP header, whatever
the extras length). The codec read the state at its offset whatever the
length said; it now refuses the message, naming the field, so a receiver
closes as 2.x did.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, FrameReader, Status
from adapters.mcbp.constants import VBucketState
from adapters.tap import TapVbucketSet, decode_frame, encode


def frame_of(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return frame


def with_length(es_len: int) -> bytes:
    data = bytearray(encode(TapVbucketSet(VBucketState.REPLICA, vbucket=3, opaque=9)))
    data[24:26] = es_len.to_bytes(2, "big")
    return bytes(data)


def test_four_bytes_decode() -> None:
    event = decode_frame(frame_of(with_length(4)))
    assert isinstance(event, TapVbucketSet) and event.state == VBucketState.REPLICA


@given(st.integers(0, 0xFFFF).filter(lambda n: n != 4))
def test_any_other_length_is_refused_naming_it(es_len: int) -> None:
    with pytest.raises(ProtocolError) as refused:
        decode_frame(frame_of(with_length(es_len)))
    assert refused.value.field == "engine_specific_length"
    assert refused.value.value == es_len
    assert refused.value.status == Status.INVALID_ARGUMENTS
