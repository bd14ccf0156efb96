"""A UPR consumer's set-up requests (``adapters.upr.consumer_handshake``).

ep-engine v3.0.0 src/upr-producer.cc ``control`` answers each CONTROL on its
own and memcached answers requests in order, so a consumer sends one set-up
request at a time; servers without the expiry opcode refuse
``enable_expiry_opcode`` (kv_engine dcp/producer.cc ``control``), which a
consumer notes and goes on; so it does for ``enable_noop`` and
``set_noop_interval`` (v3.0.0 src/upr-consumer.cc ``handleResponse`` takes
any answer to a CONTROL).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import FrameReader, Status
from adapters.upr.consumer_handshake import ConsumerHandshake, HandshakeRefused

OPTIONAL = (b"enable_expiry_opcode", b"enable_noop", b"set_noop_interval")
"""CONTROLs whose refusal the consumer notes and goes on (a 3.0 consumer takes any
answer to a CONTROL: v3.0.0 src/upr-consumer.cc ``UprConsumer::handleResponse``)."""


def decoded(data: bytes, dialect: upr.Dialect) -> upr.UprEvent:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return upr.decode_frame(frame, dialect)


@given(
    draft=st.booleans(),
    expiry=st.booleans(),
    buffer_size=st.none() | st.integers(1, 2**31),
    noop=st.none() | st.integers(1, 600),
    statuses=st.lists(st.sampled_from([0, 0, Status.NOT_SUPPORTED, Status.INVALID_ARGUMENTS])),
    strays=st.integers(0, 2),
)
def test_requests_go_one_at_a_time_and_only_needed_ones_must_succeed(
    draft: bool,
    expiry: bool,
    buffer_size: int | None,
    noop: int | None,
    statuses: list[int],
    strays: int,
) -> None:
    dialect = upr.UPR_DRAFT if draft else upr.DCP
    handshake = ConsumerHandshake(
        dialect, b"me", expiry_opcode=expiry, buffer_size=buffer_size, noop_interval=noop
    )
    expected: list[tuple[str, bytes]] = []
    if not draft:
        expected.append(("OPEN", b"me"))
        expected += [("CONTROL", b"enable_expiry_opcode")] * expiry
        expected += [("CONTROL", b"connection_buffer_size")] * (buffer_size is not None)
        expected += [("CONTROL", b"enable_noop"), ("CONTROL", b"set_noop_interval")] * (
            noop is not None
        )
    sent: list[tuple[str, bytes]] = []
    answers = iter(statuses)
    refused = None
    while (data := handshake.next_request()) is not None:
        request = decoded(data, dialect)
        key = getattr(request, "key", getattr(request, "name", b""))
        sent.append((request.NAME, key))
        with pytest.raises(RuntimeError):
            handshake.next_request()  # one at a time
        for _ in range(strays):  # what does not answer it is passed over
            other = upr.Response(request.COMMAND, request.opaque + 1000, 0)
            assert not handshake.receive(other)
        status = next(answers, 0)
        try:
            assert handshake.receive(upr.Response(request.COMMAND, request.opaque, status))
        except HandshakeRefused:
            refused = key
            assert status and key not in OPTIONAL
            break
        if status and key in OPTIONAL:
            assert handshake.granted[f"CONTROL {key.decode()}"] is False
    assert sent == expected[: len(sent)]
    if refused is None:
        assert sent == expected
        granted = handshake.granted.get("CONTROL connection_buffer_size", False)
        assert handshake.buffer_size == (buffer_size if granted and buffer_size else 0)
        assert handshake.noops == handshake.granted.get("CONTROL enable_noop", False)
        assert handshake.noops <= (noop is not None)
