"""An upstream that refuses ``enable_noop`` is streamed from without NOOPs.

A 3.0 consumer takes any answer to its CONTROLs and goes on (ep-engine
v3.0.0 src/upr-consumer.cc ``UprConsumer::handleResponse``: a CONTROL
response returns ENGINE_SUCCESS whatever its status). A producer without
NOOPs never drops a consumer for an unanswered one, so nothing depends on
them but the early sight of a dead upstream, which its closed connection
still gives. The TAP front did fail its handshake there and reconnect for
ever; it now logs one line and streams. (``connection_buffer_size`` stays
required: the front's memory is bounded by that buffer.)
"""

from __future__ import annotations

import logging

import pytest
import trio

from adapters.tap import ConnectFlags, TapMutation
from tests.support.fronts import tap_front_over_scripted
from tests.support.scripted_upr import (
    MEMORY,
    Channel,
    Request,
    ScriptedUpr,
    marker,
    mutation,
    stream_end,
    stream_ok,
)

F = ConnectFlags
EINVAL = 0x04


async def play(channel: Channel, req: Request) -> None:
    o = req.opaque
    await channel.send(
        stream_ok(req),
        marker(o, 1, 2, MEMORY),
        mutation(o, 1, b"a"),
        mutation(o, 2, b"b"),
        stream_end(o, 0),
    )


@pytest.mark.parametrize("refused", [b"enable_noop", b"set_noop_interval"])
async def test_a_refused_noop_control_is_streamed_from(
    nursery: trio.Nursery, refused: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    upr = ScriptedUpr(play, vbuckets={0: (0xABC, 0)}, refused_controls={refused: EINVAL})
    rig = await tap_front_over_scripted(nursery, upr, reconnect_attempts=0)
    caplog.set_level(logging.WARNING)
    with trio.fail_after(20):
        client = await rig.client(b"nonoop", F.LIST_VBUCKETS | F.SUPPORT_ACK, vbuckets=(0,))
        # (no BACKFILL: only new changes, the scripted ones)
        events = await client.collect()  # up to the close, acking as asked
    assert [e.key for e in events if isinstance(e, TapMutation)] == [b"a", b"b"]
    assert upr.connections == 1  # no failed handshake, no reconnect
    assert upr.controls[b"enable_noop"] == b"true"
    said = [r.getMessage() for r in caplog.records if "enable_noop" in r.getMessage()]
    assert len(said) == (refused == b"enable_noop")
