"""An unknown request inside a pushed TAP stream is answered, and the stream goes on.

A 2.x replica receiving a TAP stream is memcached: an opcode it has no
executor for goes to the engine (daemon/memcached.c
``process_bin_unknown_packet``), whose ``processUnknownCommand`` (src/
ep_engine.cc) answers UNKNOWN_COMMAND with an empty body; nothing closes the
connection. The node's receiver refused it and closed; it now takes the TAP
consumer machine's rule, as the UPR front's ingest does.
"""

from __future__ import annotations

import trio

from adapters.mcbp import Magic, Status, encode_frame
from adapters.tap import TapFlags, TapMutation, TapOpcode, TapResponse, encode
from tests.gateway.node.test_node_tap_receiver import exchange, replica_store
from tests.support.tap_client import TapClient, start_node

UNKNOWN = 0x49  # past the TAP opcodes (0x40..0x47); no 2.x engine command


async def test_an_unknown_request_is_answered_and_the_stream_goes_on(
    nursery: trio.Nursery,
) -> None:
    store = replica_store()
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        async with await TapClient.open(port) as client:
            first = TapMutation(b"a", b"v", 1, opaque=1, rev_seqno=1, tap_flags=TapFlags.ACK)
            unknown = encode_frame(Magic.REQUEST, UNKNOWN, opaque=77, key=b"k", value=b"v")
            await client.send(encode(first) + unknown)
            assert await client.next_event() == TapResponse(TapOpcode.MUTATION, 1)
            answer = await client.next_frame()  # as it came: no TAP event has opcode 0x49
            assert answer is not None
            assert (answer.magic, answer.opcode, answer.opaque) == (Magic.RESPONSE, UNKNOWN, 77)
            assert answer.vbucket_or_status == Status.UNKNOWN_COMMAND and answer.body == b""
            after = TapMutation(b"b", b"v", 1, opaque=2, rev_seqno=1, tap_flags=TapFlags.ACK)
            assert await exchange(client, after) == [TapResponse(TapOpcode.MUTATION, 2)]
    assert store.lookup(1, b"a") is not None and store.lookup(1, b"b") is not None
