"""A takeover's hand-off leaves the vbucket's other streams open, node and front alike.

ep-engine v3.0.0 src/upr-stream.cc ``ActiveStream::setVBucketStateAckRecieved``:
on the reply to SET_VBUCKET_STATE(pending) the takeover stream makes its
vbucket dead with ``setVBucketState(vb, vbucket_state_dead, false, false)``;
the last argument is src/ep.cc ``EventuallyPersistentStore::setVBucketState``'s
``notify_upr``, so ``UprConnMap::vbucketStateChanged`` (src/connmap.cc) and
src/upr-producer.cc ``UprProducer::vbucketStateChanged`` -> ``setDead(END_STREAM_STATE)``
are not reached: no other stream of the vbucket ends, producer or notifier.
They keep their checkpoint cursors, so they send what was written before the
vbucket died, then nothing more comes (a dead vbucket takes no writes). A
state change told to streams later (ns_server's SET_VBUCKET, a TAP
takeover's ``setVBucketState(vb, dead, false)``, ``deleteVBucket``) ends them
STATE_CHANGED. (The pre-release copy passed no ``notify_upr`` and so ended
them; the release passes false.)
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import trio

from gateway.node.items import VBucketState
from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, high_seqno, serve_upr_side
from tests.support.raw_dcp import RawDcp, Reply, newest_uuid, producer, take_over

NOTIFIER = 0x02
KEY_ENOENT = 0x01
END_STATE_CHANGED = 2
VB = 1


async def until_key(client: RawDcp, opaque: int, key: bytes) -> list[Reply]:
    """The stream's messages up to the mutation of ``key`` (none may be its end)."""
    out: list[Reply] = []
    while True:
        got = await client.message(opaque)
        out.append(got)
        assert got.opcode != dcp.STREAM_END, out
        if got.opcode == dcp.MUTATION and got.key == key:
            return out


async def close_after(client: RawDcp, opaque: int) -> list[Reply]:
    """CLOSE_STREAM(``VB``) then a memcached NOOP: everything up to the NOOP's reply."""
    await client.send(dcp.close_stream(VB, opaque=opaque), dcp.frame(dcp.MC_NOOP, opaque=99))
    seen: list[Reply] = []
    while not seen or (seen[-1].opcode, seen[-1].opaque) != (dcp.MC_NOOP, 99):
        seen.append(await client.message())
    return seen


@pytest.mark.parametrize("side", ["node", "front"])
async def test_takeover_leaves_other_streams_of_the_vbucket_open(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    with trio.fail_after(30):
        high = high_seqno(server, VB)
        watcher = await producer(port, b"watcher")
        await watcher.send(dcp.stream_req(VB, opaque=5))
        assert (await watcher.response(5)).status == 0
        last = b"key-%06d" % max(i for i in range(40) if i % 4 == VB)
        await until_key(watcher, 5, last)
        notifier = await producer(port, b"notified", NOTIFIER)
        uuid = await newest_uuid(notifier, VB)
        await notifier.send(
            dcp.stream_req(VB, opaque=7, start=high + 1000, uuid=uuid, snap=(high, high))
        )
        assert (await notifier.response(7)).status == 0

        def write() -> None:
            store.set(VB, b"while-pending", b"x", now=time.time())

        taker = await producer(port, b"taker")
        seen = await take_over(taker, VB, while_pending=write if side == "node" else None)
        assert [m.extras for m in seen if m.opcode == dcp.SET_VBUCKET_STATE] == [b"\x03", b"\x01"]
        assert struct.unpack(">I", seen[-1].extras)[0] == 0  # the taker's own end: OK
        if side == "node":
            # Written before the vbucket died: the other stream sends it too.
            await until_key(watcher, 5, b"while-pending")
            assert store.state(VB) is VBucketState.DEAD

        # Both still live: CLOSE_STREAM succeeds (an ended stream is KEY_ENOENT)
        # and no STREAM_END came before its response.
        for client, opaque in ((watcher, 5), (notifier, 7)):
            got = await close_after(client, 20)
            assert not [m for m in got if m.opcode == dcp.STREAM_END and m.opaque == opaque]
            assert [(m.opcode, m.status) for m in got if m.opaque == 20] == [(dcp.CLOSE_STREAM, 0)]
            await client.send(dcp.close_stream(VB, opaque=21))  # closed now: nothing to close
            assert (await client.response(21)).status == KEY_ENOENT
        for client in (watcher, notifier, taker):
            await client.aclose()


async def test_a_state_change_after_the_hand_off_ends_them(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The node: ns_server's next SET_VBUCKET on the source is a change
    ``setVBucketState`` tells (``notify_upr`` true), so the streams the hand-off
    left open end STATE_CHANGED. (The front's handed-over vbucket takes no
    state from anyone: there they stay until closed.)"""
    store = filled(40)
    _, port = await serve_upr_side(nursery, store, "node", tmp_path)
    with trio.fail_after(30):
        watcher = await producer(port, b"watcher")
        await watcher.send(dcp.stream_req(VB, opaque=5))
        assert (await watcher.response(5)).status == 0
        taker = await producer(port, b"taker")
        await take_over(taker, VB)
        assert store.state(VB) is VBucketState.DEAD
        store.set_state(VB, VBucketState.REPLICA, now=time.time())
        while True:
            got = await watcher.next()
            assert got is not None
            if got.magic == dcp.REQ and got.opcode == dcp.NOOP:
                await watcher.send(dcp.reply(got))
            elif got.opcode == dcp.STREAM_END:
                break
        assert got.opaque == 5
        assert struct.unpack(">I", got.extras)[0] == END_STATE_CHANGED
        await watcher.aclose()
        await taker.aclose()
