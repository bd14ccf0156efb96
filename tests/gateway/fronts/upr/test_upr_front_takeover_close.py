"""A takeover is done once the consumer holds VBUCKET_SET(active), however the TAP node then closes.

ep-engine 2.5.1 (src/tapconnection.cc, TapProducer: the takeover's vbucket is
set dead before VBUCKET_SET(active) is queued, and the connection is
disconnected once the last ack is in) may also send a NOOP while it waits for
that ack. The client's NOOP reply then reaches a closed socket and the
client's next read sees a reset rather than the end of the stream. Before
this was handled, the UPR front ended such a takeover stream with
STATE_CHANGED although the hand-off had completed.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.mcbp.constants import VBucketState
from adapters.tap import TapNoop, encode
from tests.gateway.fronts.upr.support import UprClient, until
from tests.support.tap_node import ask_state, read_frame, start_front_with_node

VB = 0


async def _idle(stream: trio.SocketStream, reader: FrameReader) -> None:
    await trio.sleep_forever()  # the front's own ingest: an idle stream


async def _hand_over(stream: trio.SocketStream, reader: FrameReader) -> None:
    """Hands the vbucket over to a takeover connection, then NOOP and a reset."""
    assert await ask_state(stream, reader, VB, VBucketState.PENDING, 1) == 0
    assert await ask_state(stream, reader, VB, VBucketState.ACTIVE, 2) == 0
    await stream.send_all(encode(TapNoop()))
    await read_frame(stream, reader)  # the NOOP reply, read by nobody on a real close
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()  # linger 0: the close is a reset


async def test_takeover_ends_ok_when_the_node_resets_after_the_hand_off(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    front, port = await start_front_with_node(nursery, tmp_path, _idle, _hand_over, vbuckets=(VB,))
    with trio.fail_after(10):
        await until(lambda: VB in front.logs.logs)
        client = await UprClient.connect(port)
        try:
            assert (await client.open(b"taker")).status == 0
            opened = await client.stream_request(VB, flags=upr.StreamFlags.TAKEOVER)
            assert opened.status == 0
            log = await client.read_stream(opened.opaque)
        finally:
            await client.aclose()
    assert log.states() == [upr.VBucketState.PENDING, upr.VBucketState.ACTIVE]
    end = log.end
    assert end is not None and end.reason == upr.StreamEndReason.OK
    assert VB in front.taken_over
