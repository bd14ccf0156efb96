"""The replies a 3.0 producer waits for, and what its consumer lets pass.

A scripted producer (tests/support/scripted_upr.py) plays ep-engine v3.0.0's
takeover (src/upr-stream.cc ``ActiveStream::takeoverSendPhase``: every
memory snapshot of the takeover phase carries the ACK flag, and
SET_VBUCKET_STATE goes only once each was answered; ``setVBucketStateAck
Recieved``: pending, then active, then STREAM_END) and an item whose seqno
does not grow, which the 3.0 consumer drops and goes on
(``PassiveStream::messageReceived``: ERANGE for that item only).
"""

from __future__ import annotations

import struct

import trio

from adapters.mcbp.constants import VBucketState
from adapters.tap import ConnectFlags, TapVbucketSet
from gateway.metrics.figures import TAP_FRONT
from tests.gateway.fronts.tap.test_upstream_conform import BACKFILL, run_client, shape
from tests.support.raw_dcp import MARKER, SET_VBUCKET_STATE, frame
from tests.support.scripted_upr import (
    CHECKPOINT,
    DISK,
    MEMORY,
    Channel,
    Request,
    ScriptedUpr,
    marker,
    mutation,
    stream_end,
    stream_ok,
)
from tests.support.waiting import until

F = ConnectFlags
ACK = 0x08
PENDING, ACTIVE = 0x02, 0x01
"""As memcached v3.0.0 daemon/memcached.c (``dcp_message_set_vbucket_state``) puts
them on the wire: pending as 2 and replica as 3, the draft's numbering, while the
engine's order (which its own consumer casts the byte to) has them the other way."""


def set_state(opaque: int, state: int) -> bytes:
    return frame(SET_VBUCKET_STATE, extras=struct.pack(">B", state), opaque=opaque)


async def test_a_3_0_takeover_gets_each_reply_it_waits_for(nursery: trio.Nursery) -> None:
    """The TAP peer sees VBUCKET_SET(pending) then VBUCKET_SET(active), as a 2.x
    takeover sent them: a producer sends no other state in a stream (ep-engine
    3.0 ``ActiveStream``: ``takeoverState`` is pending, then active), so the 2 a
    3.0 producer sends is pending, whatever the engine's order calls 2."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        upr = channel.upr

        async def answered(opcode: int, count: int) -> None:
            with trio.fail_after(10):
                await until(lambda: len(upr.replies(opcode)) >= count)

        assert req.flags & 0x01  # TAKEOVER
        await channel.send(
            stream_ok(req),
            marker(o, 0, 4, DISK),
            *(mutation(o, s, b"%d" % s) for s in (1, 2, 3, 4)),
            marker(o, 5, 6, MEMORY | CHECKPOINT | ACK),
            mutation(o, 5, b"5"),
            mutation(o, 6, b"6"),
        )
        await answered(MARKER, 1)
        await channel.send(set_state(o, PENDING))
        await answered(SET_VBUCKET_STATE, 1)
        await channel.send(marker(o, 7, 7, MEMORY | ACK), mutation(o, 7, b"7"))
        await answered(MARKER, 2)
        await channel.send(set_state(o, ACTIVE))
        await answered(SET_VBUCKET_STATE, 2)
        await channel.send(stream_end(o, 0))

    upr = ScriptedUpr(play)
    events, front = await run_client(nursery, upr, BACKFILL | F.TAKEOVER_VBUCKETS)
    assert shape(events) == ["I", "m1", "m2", "m3", "m4", "C", "S", "m5", "m6", "E", "S", "m7", "E"]
    states = [e.state for e in events if isinstance(e, TapVbucketSet)]
    assert states == [VBucketState.PENDING, VBucketState.ACTIVE]
    opaque = upr.requests[0].opaque
    for reply in upr.replies(MARKER) + upr.replies(SET_VBUCKET_STATE):
        assert (reply.opaque, reply.status, reply.extras, reply.key, reply.value) == (
            opaque, 0, b"", b"", b""
        )  # fmt: skip
    assert front.stats.takeovers_completed_total[TAP_FRONT] == 1


async def test_an_item_whose_seqno_does_not_grow_is_dropped_and_the_stream_goes_on(
    nursery: trio.Nursery,
) -> None:
    """v3.0.0 src/upr-stream.cc ``PassiveStream::messageReceived`` drops an item
    whose by_seqno is not above the last one (ERANGE, which the producer ignores:
    src/upr-producer.cc ``UprProducer::handleResponse``) and keeps the stream; the TAP peer
    gets every other item once, and the dropped item's bytes still return to
    the producer's buffer."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(stream_ok(req))
        await channel.send_counted(
            marker(o, 0, 4, DISK),
            mutation(o, 1, b"1"),
            mutation(o, 2, b"2"),
            mutation(o, 2, b"2-again"),
            mutation(o, 1, b"1-again"),
            mutation(o, 3, b"3"),
            mutation(o, 4, b"4"),
            marker(o, 5, 5, MEMORY),
            mutation(o, 5, b"5"),
        )
        with trio.fail_after(10):
            await until(lambda: channel.upr.outstanding == 0)
        await channel.send(stream_end(o, 0))

    upr = ScriptedUpr(play)
    events, front = await run_client(nursery, upr, buffer_size=100_000)
    assert shape(events) == ["I", "m1", "m2", "m3", "m4", "C", "S", "m5", "E"]
    assert front.stats.protocol_errors_total[TAP_FRONT, "upstream_seqno_not_growing"] == 2


async def test_a_dropped_item_returns_its_buffer_bytes_on_its_own(nursery: trio.Nursery) -> None:
    """The bytes of a dropped item come back to the producer even when no TAP
    message follows it to carry them: a 3.0 producer holding a large item
    (v3.0.0 src/upr-producer.cc ``BufferLog::insert``) must not wait on them."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(stream_ok(req))
        await channel.send_counted(marker(o, 0, 3, DISK), mutation(o, 1, b"1"))
        with trio.fail_after(10):
            await until(lambda: channel.upr.outstanding == 0)
        await channel.send_counted(mutation(o, 1, b"1-again"))
        await channel.send_counted(
            mutation(o, 2, b"2", b"x" * 900), mutation(o, 3, b"3"), stream_end(o, 0)
        )

    upr = ScriptedUpr(play)
    events, _ = await run_client(nursery, upr, buffer_size=1000)
    assert shape(events) == ["I", "m1", "m2", "m3", "C"]
