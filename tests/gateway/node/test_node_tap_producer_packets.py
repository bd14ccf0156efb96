"""What the node's TAP producer does with each TAP packet its client sends.

A NOOP is answered and the answer to the producer's own keep-alive is taken
silently, as memcached 2.x answered a binary NOOP on any connection, a TAP
one included (daemon/memcached.c ``conn_ship_log`` runs every packet through
the command dispatcher); acks go to the ack window (test_node_tap_acks). A
stream message sent the wrong way is the node's own refusal
(gateway/node/tap_producer.py ``_not_allowed``): NOT_SUPPORTED, naming the
message, then the close.
"""

from __future__ import annotations

import time

import trio

from adapters.mcbp import Status
from adapters.tap import (
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpcode,
    TapResponse,
    encode,
)
from gateway.node.store import Store
from tests.support.tap_client import TapClient, connect_event, start_node


async def test_noops_are_answered_and_a_stream_message_is_refused(
    nursery: trio.Nursery,
) -> None:
    store = Store(1)
    _, port = await start_node(nursery, store, vbuckets=1)
    with trio.fail_after(10):
        async with await TapClient.open(port, connect_event(b"packets")) as client:
            # The answer to a keep-alive first: ignored, so the NOOP after it is answered.
            await client.send(encode(TapNoopResponse(0x11)) + encode(TapNoop(0x55)))
            events = await client.collect(lambda e: isinstance(e, TapNoopResponse))
            assert events[-1] == TapNoopResponse(0x55)
            assert all(isinstance(e, TapNoop) for e in events[:-1]), events
            store.set(0, b"live", b"v", now=time.time())
            events = await client.collect(lambda e: isinstance(e, TapMutation))
            assert events[-1].key == b"live"  # type: ignore[union-attr]
            await client.send(encode(TapMutation(b"back", b"v", 0, opaque=0x66)))
            events = await client.collect()
    refusals = [e for e in events if isinstance(e, TapResponse)]
    assert len(refusals) == 1, events
    refusal = refusals[0]
    assert (refusal.opcode, refusal.opaque) == (TapOpcode.MUTATION, 0x66)
    assert refusal.status == Status.NOT_SUPPORTED and b"MUTATION" in refusal.text
    assert client.closed
