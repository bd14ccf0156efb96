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
from functools import partial
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import Frame, FrameReader
from adapters.mcbp.constants import VBucketState
from adapters.tap import TapFlags, TapNoop, TapVbucketSet, encode
from tests.gateway.fronts.upr.support import UprClient, start_front, until

TAKEOVER_VBUCKETS = 0x08
VB = 0


async def _frame(stream: trio.SocketStream, reader: FrameReader) -> Frame:
    while (frame := reader.next_frame()) is None:
        data = await stream.receive_some(65536)
        assert data, "the gateway closed the TAP connection"
        reader.receive_data(data)
    return frame


async def _ask_and_wait(
    stream: trio.SocketStream, reader: FrameReader, state: int, opaque: int
) -> None:
    await stream.send_all(
        encode(TapVbucketSet(VBucketState(state), VB, opaque=opaque, tap_flags=TapFlags.ACK))
    )
    while True:
        frame = await _frame(stream, reader)
        if not frame.is_request and frame.opaque == opaque:
            assert frame.vbucket_or_status == 0
            return


async def _tap_node(stream: trio.SocketStream) -> None:
    """Hands the vbucket over to a takeover connection, then NOOP and a reset."""
    reader = FrameReader()
    connect = await _frame(stream, reader)
    (flags,) = struct.unpack_from(">I", connect.extras)
    if not flags & TAKEOVER_VBUCKETS:
        await trio.sleep_forever()  # the front's own ingest: an idle stream
    await _ask_and_wait(stream, reader, VBucketState.PENDING, 1)
    await _ask_and_wait(stream, reader, VBucketState.ACTIVE, 2)
    await stream.send_all(encode(TapNoop()))
    await _frame(stream, reader)  # the NOOP reply, read by nobody on a real close
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()  # linger 0: the close is a reset


async def test_takeover_ends_ok_when_the_node_resets_after_the_hand_off(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    listeners = await nursery.start(partial(trio.serve_tcp, _tap_node, 0, host="127.0.0.1"))
    node_port = listeners[0].socket.getsockname()[1]
    front, port, _ = await start_front(nursery, tmp_path, node_port, vbuckets=(VB,))
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
