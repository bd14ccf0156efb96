"""Notifier connections (OPEN flag 0x02 alone), on the reference node and the
UPR front alike, with requests packed byte by byte (``tests.support.raw_dcp``).

ep-engine 3.0 src/ep_engine.cc ``uprOpen`` makes a notifier a ``UprProducer``
with ``notifyOnly``; src/upr-producer.cc ``UprProducer::streamRequest`` skips
the range checks for it and hands the rollback rule a start of at most the
high seqno, then answers as for any stream (the failover log); src/upr-stream.cc
``NotifierStream`` sends no items, only STREAM_END(OK, flag 0) once the
vbucket's high seqno exceeds the start (at once when it already does), and
``setDead`` ends it with the reason it is given (STATE_CHANGED, 2, on a
vbucket state change). CLOSE_STREAM (``closeStream``) drops it before its end
could go. The connection shows ``type`` ``notifier`` (``UprProducer::getType``)
and the stream ``Stream::addStats``'s lines.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters.mcbp.constants import VBucketState
from tests.gateway.fronts.upr.support import caught_up
from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, high_seqno, serve_upr_side
from tests.support.raw_dcp import RawDcp, Reply, newest_uuid, producer, stats
from tests.support.upr_client import until

NOTIFIER = 0x02
KEY_EEXISTS, ROLLBACK = 0x02, 0x23
END_OK, END_STATE_CHANGED = 0, 2

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


async def notifier(port: int, name: bytes) -> RawDcp:
    return await producer(port, name, NOTIFIER)


def end_flag(message: Reply) -> int:
    assert message.opcode == dcp.STREAM_END, message
    return int(struct.unpack(">I", message.extras)[0])


async def write(server: Any, store: Any, side: str, vbucket: int, key: bytes) -> None:
    store.set(vbucket, key, b"x", now=time.time())
    if side == "front":
        await until(lambda: caught_up(server, store))


async def test_a_start_already_passed_ends_at_once_with_no_items(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    assert high_seqno(server, 1) > 3
    with trio.fail_after(20):
        client = await notifier(port, b"xdcr-notify")
        uuid = await newest_uuid(client, 1)
        await client.send(dcp.stream_req(1, opaque=10, start=3, uuid=uuid))
        answer = await client.response(10)
        assert answer.status == 0 and len(answer.value) % 16 == 0 and answer.value
        end = await client.message(10)
        assert end_flag(end) == END_OK and end.status == 1  # the vbucket field
        await client.aclose()


async def test_a_start_at_the_high_seqno_waits_for_the_next_write(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 2)
    with trio.fail_after(20):
        client = await notifier(port, b"waiter")
        uuid = await newest_uuid(client, 2)
        await client.send(dcp.stream_req(2, opaque=11, start=high, uuid=uuid))
        assert (await client.response(11)).status == 0
        # Nothing yet: memcached's NOOP (0x0a) is answered before anything of the stream.
        await client.send(dcp.frame(dcp.MC_NOOP, opaque=12))
        barrier = await client.next()
        assert barrier is not None and (barrier.opcode, barrier.opaque) == (dcp.MC_NOOP, 12)
        await write(server, store, side, 2, b"wake")
        end = await client.message(11)
        assert end_flag(end) == END_OK
        await client.aclose()


async def test_no_range_checks_but_the_rollback_rule(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """A start past the high seqno and past the end, outside its snapshot, is
    accepted (the rollback rule sees the high seqno as its start); an unknown
    vbucket uuid still rolls back to 0; a second request on a vbucket with a
    live notifier stream is KEY_EEXISTS, bad range or not."""
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 1)
    with trio.fail_after(20):
        client = await notifier(port, b"ranges")
        uuid = await newest_uuid(client, 1)
        far = high + 100
        await client.send(dcp.stream_req(1, opaque=10, start=far, end=5, uuid=uuid, snap=(0, 0)))
        assert (await client.response(10)).status == 0
        await client.send(dcp.stream_req(1, opaque=11, start=far, end=5, uuid=uuid, snap=(0, 0)))
        assert (await client.response(11)).status == KEY_EEXISTS
        await client.send(dcp.stream_req(2, opaque=12, start=5, uuid=0xBAD, snap=(5, 5)))
        refused = await client.response(12)
        assert refused.status == ROLLBACK and struct.unpack(">Q", refused.value)[0] == 0
        await client.aclose()


async def test_close_stream_ends_it_without_a_stream_end(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 3)
    with trio.fail_after(20):
        client = await notifier(port, b"closer")
        uuid = await newest_uuid(client, 3)
        await client.send(dcp.stream_req(3, opaque=10, start=high, uuid=uuid))
        assert (await client.response(10)).status == 0
        await client.send(dcp.close_stream(3, opaque=11))
        assert (await client.response(11)).status == 0
        await write(server, store, side, 3, b"after-close")
        await client.send(dcp.close_stream(3, opaque=12))  # gone: KEY_ENOENT
        got = await client.next()
        assert got is not None and (got.opcode, got.opaque) == (dcp.CLOSE_STREAM, 12)
        assert got.status == 0x01
        await client.aclose()


async def test_stat_dcp_names_a_notifier_and_its_stream(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """NOOPs and flow control apply to a notifier as to any ``UprProducer``."""
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 1)
    with trio.fail_after(20):
        client = await notifier(port, b"shown")
        await client.send(dcp.control(b"enable_noop", b"true", opaque=2))
        assert (await client.response(2)).status == 0
        await client.send(dcp.control(b"connection_buffer_size", b"1024", opaque=3))
        assert (await client.response(3)).status == 0
        uuid = await newest_uuid(client, 1)
        await client.send(dcp.stream_req(1, opaque=10, start=high, uuid=uuid))
        assert (await client.response(10)).status == 0
        status, pairs = await stats(port, b"dcp")
        assert status == 0
        head = "eq_dcpq:shown:"
        assert pairs[head + "type"] == "notifier"
        assert pairs[head + "noop_enabled"] == "true"
        assert pairs[head + "flow_control"] == "enabled"
        assert pairs[head + "stream_1_state"] == "pending"
        assert pairs[head + "stream_1_start_seqno"] == str(high)
        assert pairs[head + "stream_1_opaque"] == "10"
        await write(server, store, side, 1, b"wake")
        assert end_flag(await client.message(10)) == END_OK
        status, pairs = await stats(port, b"dcp")
        assert pairs[head + "stream_1_state"] == "dead"
        assert int(pairs[head + "unacked_bytes"]) == 24 + 4  # the STREAM_END counts
        await client.aclose()


async def test_a_state_change_ends_it_state_changed(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine 3.0 src/ep.cc ``setVBucketState`` tells every stream of the
    vbucket (``UprConnMap::vbucketStateChanged``): ``setDead(END_STREAM_STATE)``."""
    if side == "front":
        pytest.skip("the UPR front's vbuckets change state only by a takeover")
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 0)
    with trio.fail_after(20):
        client = await notifier(port, b"stated")
        uuid = await newest_uuid(client, 0)
        await client.send(dcp.stream_req(0, opaque=10, start=high, uuid=uuid))
        assert (await client.response(10)).status == 0
        store.set_state(0, VBucketState.REPLICA, now=time.time())
        assert end_flag(await client.message(10)) == END_STATE_CHANGED
        await client.aclose()
