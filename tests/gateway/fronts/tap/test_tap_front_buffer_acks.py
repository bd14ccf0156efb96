"""The TAP front returns its upstream's flow-control buffer as a 3.0 consumer does.

ep-engine's DCP consumer sends a BUFFER_ACKNOWLEDGEMENT once at least 20% of
its buffer is drained (dcp/flow-control.cc, ``handleFlowCtl`` and
``isBufferSufficientlyDrained``), not one per message processed: the front
likewise gathers what its TAP peer's acks free and returns it in acks of at
least a fifth of the buffer, never more than it received.
"""

from __future__ import annotations

import trio

from adapters import upr
from adapters.mcbp import FrameReader
from gateway.fronts.tap.upstream import UprUpstream
from gateway.io.connection import PacketConnection


class Sink:
    def __init__(self) -> None:
        self.sent = bytearray()

    async def send_all(self, data: bytes) -> None:
        self.sent += data


def acks(sink: Sink) -> list[int]:
    reader = FrameReader()
    reader.receive_data(sink.sent)
    events = [upr.decode_frame(frame) for frame in reader.frames()]
    return [e.buffer_bytes for e in events if isinstance(e, upr.BufferAcknowledgement)]


async def test_buffer_acks_return_a_fifth_of_the_buffer_at_least() -> None:
    sink = Sink()
    upstream = UprUpstream(PacketConnection(sink), "upstream", upr.DCP)  # type: ignore[arg-type]
    upstream.window.buffer_size = 1000
    upstream.window.unacked_bytes = 1000
    for _ in range(3):
        await upstream.acknowledge(60)
    assert not sink.sent and upstream.window.unacked_bytes == 1000
    await upstream.acknowledge(30)
    assert acks(sink) == [210] and upstream.window.unacked_bytes == 790
    await upstream.acknowledge(790)
    assert acks(sink) == [210, 790] and upstream.window.unacked_bytes == 0


async def test_without_flow_control_nothing_is_acknowledged() -> None:
    sink = Sink()
    upstream = UprUpstream(PacketConnection(sink), "upstream", upr.DCP)  # type: ignore[arg-type]
    await upstream.acknowledge(100)
    await trio.lowlevel.checkpoint()
    assert not sink.sent
