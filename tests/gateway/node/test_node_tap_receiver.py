"""The node as the receiver of a TAP stream someone pushes into it."""

from __future__ import annotations

import time

import trio

from adapters.mcbp import Magic, Opcode, Status, encode_frame
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlags,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapOpcode,
    TapResponse,
    TapVbucketSet,
    encode,
)
from gateway.node.items import VBucketState
from gateway.node.store import Store
from tests.support.tap_client import TapClient, start_node

ACK = TapFlags.ACK
NBO = TapFlags.NETWORK_BYTE_ORDER


def replica_store() -> Store:
    store = Store(4, initial_state=VBucketState.REPLICA)
    store.set_state(3, VBucketState.ACTIVE, now=time.time())
    return store


async def exchange(client: TapClient, *messages: object) -> list[object]:
    """Send ``messages``, then a NOOP, and return every reply before the NOOP's."""
    await client.send(b"".join(encode(m) for m in messages))  # type: ignore[arg-type]
    await client.send(encode(TapNoop(opaque=0xABC)))
    replies: list[object] = []
    while not isinstance(reply := await client.next_event(), TapNoopResponse):
        replies.append(reply)
    assert reply.opaque == 0xABC
    return replies


async def test_messages_apply_with_their_metadata_and_acks_answer(nursery: trio.Nursery) -> None:
    store = replica_store()
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        async with await TapClient.open(port) as client:
            replies = await exchange(
                client,
                TapMutation(
                    b"a",
                    b"va",
                    1,
                    opaque=1,
                    cas=77,
                    flags=0x01000000,
                    expiration=0,
                    rev_seqno=5,
                    nru=2,
                ),
                TapMutation(
                    b"b",
                    b"vb",
                    1,
                    opaque=2,
                    cas=78,
                    flags=0x00000001,
                    rev_seqno=9,
                    tap_flags=NBO | ACK,
                ),
                TapDelete(b"c", 1, opaque=3, cas=79, rev_seqno=4, tap_flags=ACK),
                TapMutation(b"d", b"vd", 1, opaque=4, cas=80),  # no 2.x metadata
            )
            assert replies == [
                TapResponse(TapOpcode.MUTATION, 2, 0),
                TapResponse(TapOpcode.DELETE, 3, 0),
            ]
    a, b, c, d = (store.lookup(1, key) for key in (b"a", b"b", b"c", b"d"))
    assert a is not None and (a.value, a.cas, a.rev_seqno, a.flags) == (b"va", 77, 5, 1)
    assert b is not None and (b.value, b.cas, b.rev_seqno, b.flags) == (b"vb", 78, 9, 1)
    assert c is not None and c.deleted and (c.cas, c.rev_seqno) == (79, 4)
    assert d is not None and d.rev_seqno == 1


async def test_refusals_are_nacked_and_the_stream_goes_on(nursery: trio.Nursery) -> None:
    store = replica_store()
    store.set_state(2, VBucketState.DEAD, now=time.time())
    store.set(3, b"mine", b"active data", now=time.time())
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        async with await TapClient.open(port) as client:
            replies = await exchange(
                client,
                TapMutation(b"loop", b"v", 1, opaque=1, rev_seqno=1, ttl=0),
                TapMutation(b"x", b"v", 2, opaque=2, rev_seqno=1),
                TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, 3, opaque=3, tap_flags=ACK),
                TapMutation(b"keys", b"", 1, opaque=4, rev_seqno=1, tap_flags=TapFlags.NO_VALUE),
                TapMutation(b"fine", b"v", 1, opaque=5, rev_seqno=1, tap_flags=ACK),
            )
    statuses = [(r.opaque, r.status) for r in replies]  # type: ignore[attr-defined]
    assert statuses == [
        (1, Status.INVALID_ARGUMENTS),  # TTL ran out: a relay loop
        (2, Status.NOT_MY_VBUCKET),  # dead vbucket, nacked though no ack was asked
        (3, Status.NOT_MY_VBUCKET),  # would wipe an active vbucket
        (4, Status.NOT_SUPPORTED),
        (5, Status.SUCCESS),
    ]
    assert all(r.text for r in replies[:4])  # type: ignore[attr-defined]
    assert store.lookup(1, b"loop") is None and store.lookup(2, b"x") is None
    assert store.lookup(3, b"mine") is not None and store.lookup(1, b"fine") is not None


async def test_initial_stream_state_changes_and_checkpoints(nursery: trio.Nursery) -> None:
    store = replica_store()
    now = time.time()
    for i in range(5):
        store.apply_mutation(
            0, b"stale-%d" % i, b"old", flags=0, expiration=0, cas=i + 1, rev_seqno=1, now=now
        )
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        async with await TapClient.open(port) as client:
            replies = await exchange(
                client,
                TapVbucketSet(VBucketState.PENDING, 0, opaque=1, tap_flags=ACK),
                TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, 0, opaque=2, tap_flags=ACK),
                TapCheckpointStart(7, 0, opaque=3, tap_flags=ACK),
                TapMutation(b"new", b"v", 0, opaque=4, cas=99, rev_seqno=3, tap_flags=NBO),
                TapCheckpointEnd(7, 0, opaque=5, tap_flags=ACK),
                TapVbucketSet(VBucketState.ACTIVE, 0, opaque=6, tap_flags=ACK),
                TapOpaque(OpaqueCode.CLOSE_TAP_STREAM, 0, opaque=7, tap_flags=ACK),
            )
    acked = [(r.opaque, r.status) for r in replies]  # type: ignore[attr-defined]
    assert acked == [(i, 0) for i in (1, 2, 3, 5, 6, 7)]  # 4 asked for no ack
    assert [it.key for it in store.items_since(0, 0)] == [b"new"]
    assert store.lookup(0, b"new").checkpoint_id == 7  # type: ignore[union-attr]
    assert store.vbucket_stats(0).last_closed_checkpoint_id == 7
    assert store.state(0) is VBucketState.ACTIVE


async def test_malformed_message_gets_an_error_and_the_connection_closes(
    nursery: trio.Nursery,
) -> None:
    store = replica_store()
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        other = await TapClient.open(port)
        async with await TapClient.open(port) as client:
            # A DELETE whose body is shorter than the TAP header.
            await client.send(
                encode_frame(Magic.REQUEST, TapOpcode.DELETE, opaque=9, extras=b"\x00\x00")
            )
            reply = await client.next_event()
            assert isinstance(reply, TapResponse) and reply.opaque == 9
            assert reply.status == Status.INVALID_ARGUMENTS and reply.text
            assert await client.next_event() is None
        assert await exchange(other, TapMutation(b"k", b"v", 1, opaque=1, rev_seqno=1)) == []
        await other.send(encode_frame(Magic.REQUEST, Opcode.QUIT))
        await other.aclose()
    assert store.lookup(1, b"k") is not None
