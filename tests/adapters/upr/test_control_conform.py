"""CONTROL ``set_noop_interval`` as later 3.x ep-engine reads it.

3.0.0's src/upr-producer.cc ``UprProducer::control`` knew no such key
(EINVAL); later src/dcp-producer.cc ``DcpProducer::control`` reads the value
with ``parseUint32`` (src/utility.cc, ``strtoul``): any 32-bit decimal, 0
included, with leading blanks, a ``+`` or a blank-separated tail, is
SUCCESS. 3.x counts NOOP time in whole seconds (``ep_current_time``), so an
interval of 0 sends a NOOP at the next second: one second here. (A fraction
of a second is ours, beyond 3.0.)
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adapters import upr
from adapters.mcbp import FrameReader, Status
from adapters.upr.producer_machine import ProducerMachine, Reply


@dataclass
class FakeStream:
    opaque: int
    live: bool = True


def answer(outputs: tuple[object, ...]) -> int:
    reader = FrameReader()
    for output in outputs:
        if isinstance(output, Reply):
            reader.receive_data(output.data)
    (frame,) = reader.frames()
    return frame.vbucket_or_status


@pytest.mark.parametrize(
    ("value", "interval"),
    [(b"0", 1.0), (b"20", 20.0), (b" 30", 30.0), (b"+5", 5.0), (b"7 seconds", 7.0), (b"0.5", 0.5)],
)
def test_noop_interval_values_3_0_takes(value: bytes, interval: float) -> None:
    m: ProducerMachine[FakeStream] = ProducerMachine("c", upr.DCP, noop_interval=10.0)
    outputs = m.receive(upr.Control(b"set_noop_interval", value, opaque=2), 0.0)
    assert answer(outputs) == 0
    assert m.noop_interval == interval


@pytest.mark.parametrize("value", [b"-1", b"x", b"", b"4294967296"])
def test_noop_interval_values_3_0_refuses(value: bytes) -> None:
    m: ProducerMachine[FakeStream] = ProducerMachine("c", upr.DCP, noop_interval=10.0)
    outputs = m.receive(upr.Control(b"set_noop_interval", value, opaque=2), 0.0)
    assert answer(outputs) == Status.INVALID_ARGUMENTS
    assert m.noop_interval == 10.0


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        # ``strncmp(key, known, nkey)``: the C string's NUL sent along still names it.
        (b"connection_buffer_size\x00", 0),
        (b"enable_noop\x00", 0),
        (b"stream_buffer_size\x00", Status.NOT_SUPPORTED),
        # A prefix of a known key names the first 3.0 tries.
        (b"connection", 0),
        (b"enable_no", 0),
        # Longer than a known key, or differing: unknown.
        (b"connection_buffer_sizes", Status.INVALID_ARGUMENTS),
        (b"enable_noop_x", Status.INVALID_ARGUMENTS),
        (b"xyz", Status.INVALID_ARGUMENTS),
    ],
)
def test_control_keys_are_matched_as_3_0_strncmp_matches_them(key: bytes, expected: int) -> None:
    """src/upr-producer.cc ``UprProducer::control`` compares each known key with
    ``strncmp(param, "connection_buffer_size", nkey)`` and so on, in that order."""
    m: ProducerMachine[FakeStream] = ProducerMachine("c", upr.DCP, noop_interval=10.0)
    outputs = m.receive(upr.Control(key, b"true" if b"noop" in key else b"4096", opaque=2), 0.0)
    assert answer(outputs) == expected
