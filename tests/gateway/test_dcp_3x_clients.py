"""3.0-era DCP clients against the reference node and the UPR front alike.

Every request here is packed byte by byte as a 3.0-era Python DCP client
packs it (``tests.support.raw_dcp``), not through the project's encoder, and
each test runs on both sides: the node is the test peer of the front, so a
misreading shared by both would otherwise pass. Each test names the
ep-engine v3.0.0 / memcached source it follows.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.support import raw_dcp as dcp
from tests.support.fronts import caught_up, filled, high_seqno, serve_upr_side
from tests.support.raw_dcp import Reply, producer, read_stream, stats, take_over
from tests.support.waiting import until

VBUCKETS = 4
EINVAL, NOT_MY_VBUCKET, KEY_ENOENT, NOT_SUPPORTED = 0x04, 0x07, 0x01, 0x83

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


async def test_buffer_ack_beyond_what_is_outstanding_empties_the_window_silently(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/upr-producer.cc ``BufferLog::free`` clamps at zero and
    ``UprProducer::bufferAcknowledgement`` returns success, which memcached
    v3.0.0 daemon/memcached.c answers with nothing at all."""
    server, port = await serve_upr_side(nursery, filled(40), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"greedy")
        await client.send(dcp.control(b"connection_buffer_size", b"4096", opaque=2))
        assert (await client.response(2)).status == 0
        await client.send(dcp.stream_req(1, opaque=10, end=high_seqno(server, 1)))
        assert (await client.response(10)).status == 0
        sent = sum(m.size for m in await read_stream(client, 10))
        # memcached's NOOP (0x0a) as a barrier: a producer takes no UPR NOOP request.
        await client.send(dcp.buffer_ack(sent + 1000, opaque=77), dcp.frame(dcp.MC_NOOP, opaque=78))
        answer = await client.next()  # the NOOP's answer: nothing for the ack before it
        assert answer is not None and (answer.opcode, answer.opaque) == (dcp.MC_NOOP, 78)
        status, pairs = await stats(port, b"dcp")
        assert status == 0 and pairs["eq_dcpq:greedy:unacked_bytes"] == "0"
        await client.send(
            dcp.stream_req(2, opaque=11, end=high_seqno(server, 2))
        )  # still streaming
        assert (await client.response(11)).status == 0
        assert len(await read_stream(client, 11)) == 12  # marker, 10 items, end
        await client.aclose()


async def test_control_keys_known_but_unsupported_are_not_supported(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/upr-producer.cc ``UprProducer::control``:
    stream_buffer_size is ENGINE_ENOTSUP (0x83), a key it does not know
    ENGINE_EINVAL (0x04); neither closes the connection."""
    _, port = await serve_upr_side(nursery, filled(8), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"ctl")
        for opaque, key, value, status in [
            (2, b"stream_buffer_size", b"1024", NOT_SUPPORTED),
            (3, b"no_such_key", b"1", EINVAL),
            (4, b"connection_buffer_size", b"1024", 0),
        ]:
            await client.send(dcp.control(key, value, opaque))
            got = await client.response(opaque)
            assert (got.opcode, got.status) == (dcp.CONTROL, status), key
            assert status == 0 or key in got.value
        await client.aclose()


async def test_control_values_are_read_as_3_0_reads_them(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/upr-producer.cc ``UprProducer::control``: enable_noop
    is on for "true" and off for any other value, never EINVAL. Numbers as
    later 3.x src/dcp-producer.cc ``DcpProducer::control`` reads them, through
    ``parseUint32`` (src/utility.cc, ``strtoul``; 3.0.0 used ``atoi``, which
    took more): leading blanks, a ``+`` and a blank-separated tail are fine, a
    ``-`` or junk is EINVAL."""
    server, port = await serve_upr_side(nursery, filled(8), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"ctl")
        for opaque, key, value, status in [
            (2, b"enable_noop", b"yes", 0),
            (3, b"enable_noop", b"TRUE", 0),
            (4, b"enable_noop", b"", 0),
            (5, b"connection_buffer_size", b" +4096", 0),
            (6, b"connection_buffer_size", b"4096 bytes", 0),
            (7, b"connection_buffer_size", b"-1", EINVAL),
            (8, b"connection_buffer_size", b"4k", EINVAL),
            (9, b"connection_buffer_size", b"4294967296", EINVAL),
        ]:
            await client.send(dcp.control(key, value, opaque))
            got = await client.response(opaque)
            assert (got.opcode, got.status) == (dcp.CONTROL, status), (key, value)
            assert status == 0 or key in got.value
        # The connection is still open and serving.
        server_high = high_seqno(server, 0)
        await client.send(dcp.stream_req(0, opaque=11, end=server_high))
        assert (await client.response(11)).status == 0
        await client.aclose()


async def test_expiry_opcode_only_with_delete_times(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """Servers that know ``enable_expiry_opcode`` accept it only on a connection
    opened with include-delete-times (0x20), else EINVAL (kv_engine
    dcp/producer.cc ``DcpProducer::control``); EXPIRATION then has 20 bytes of
    extras and DELETION 21 (by_seqno, rev_seqno, delete_time, one unused byte).
    Without the flag the v3.0.0 layouts stay (upr-producer.cc ``step``: 18)."""
    store = filled(8, removals=True)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    with trio.fail_after(20):
        # It expires once the front knows its expiry time: TAP tells a front
        # nothing else, and a tombstone from a backfill is a plain delete.
        assert len(store.expire(time.time() + 10)) == 1
        if side == "front":
            await until(lambda: caught_up(server, store))
        high = high_seqno(server, 0)
        plain = await producer(port, b"plain")
        await plain.send(dcp.control(b"enable_expiry_opcode", b"true", opaque=2))
        refused = await plain.response(2)
        assert refused.status == EINVAL and b"0x20" in refused.value
        await plain.send(dcp.stream_req(0, opaque=5, end=high))
        assert (await plain.response(5)).status == 0
        old = [(m.opcode, len(m.extras)) for m in await read_stream(plain, 5)]
        assert (dcp.DELETION, 18) in old and not [m for m in old if m[0] == dcp.EXPIRATION]
        await plain.aclose()

        timed = await producer(port, b"timed", dcp.PRODUCER | dcp.INCLUDE_DELETE_TIMES)
        await timed.send(dcp.control(b"enable_expiry_opcode", b"true", opaque=2))
        assert (await timed.response(2)).status == 0
        await timed.send(dcp.stream_req(0, opaque=5, end=high))
        assert (await timed.response(5)).status == 0
        messages = await read_stream(timed, 5)
        removed = {m.key: m for m in messages if m.opcode in (dcp.DELETION, dcp.EXPIRATION)}
        deleted, expired = removed[b"key-%06d" % 0], removed[b"expires"]
        assert (deleted.opcode, len(deleted.extras)) == (dcp.DELETION, 21)
        assert (expired.opcode, len(expired.extras)) == (dcp.EXPIRATION, 20)
        delete_time = struct.unpack_from(">I", expired.extras, 16)[0]
        if side == "node":
            assert delete_time == store.lookup(0, b"expires").delete_time
        else:  # TAP carries no delete time: the front keeps the delete's arrival
            assert delete_time > 0
        await timed.aclose()


async def test_stat_failovers_lists_the_failover_log_as_the_wire_gives_it(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/ep_engine.cc ``doVbIdFailoverLogStats`` /
    ``doAllFailoverLogStats`` and src/failover-table.cc ``addStats``:
    ``vb_N:num_entries``, then ``vb_N:M:id`` and ``vb_N:M:seq``, newest first,
    the same entries GET_FAILOVER_LOG returns."""
    store = filled(16)
    store.failover(1)  # a second history entry
    store.set(1, b"after", b"x", now=time.time())
    _, port = await serve_upr_side(nursery, store, side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"fo")
        await client.send(dcp.frame(dcp.FAILOVER_LOG, vbucket=1, opaque=9))
        got = await client.response(9)
        wire = [struct.unpack_from(">QQ", got.value, i) for i in range(0, len(got.value), 16)]
        await client.aclose()
        status, pairs = await stats(port, b"failovers 1")
        assert status == 0
        expected = {"vb_1:num_entries": str(len(wire))}
        for i, (uuid, seqno) in enumerate(wire):
            expected |= {f"vb_1:{i}:id": str(uuid), f"vb_1:{i}:seq": str(seqno)}
        assert pairs == expected
        status, every = await stats(port, b"failovers")
        assert status == 0
        assert [k for k in every if k.endswith(":num_entries")] == [
            f"vb_{vb}:num_entries" for vb in range(VBUCKETS)
        ]
        assert (await stats(port, b"failovers x"))[0] == EINVAL


async def test_stat_vbucket_seqno_refuses_a_bad_or_foreign_vbucket(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/ep_engine.cc ``doSeqnoStats``: an argument that is not
    a number is ENGINE_EINVAL (0x04), a vbucket the node does not have
    ENGINE_NOT_MY_VBUCKET (0x07)."""
    server, port = await serve_upr_side(nursery, filled(16), side, tmp_path)
    with trio.fail_after(20):
        status, pairs = await stats(port, b"vbucket-seqno 1")
        assert status == 0 and pairs["vb_1:high_seqno"] == str(high_seqno(server, 1))
        assert (await stats(port, b"vbucket-seqno one"))[0] == EINVAL
        assert (await stats(port, b"vbucket-seqno 99"))[0] == NOT_MY_VBUCKET
        assert (await stats(port, b"vbucket-seqno"))[0] == 0


async def test_stat_dcp_has_its_totals_with_no_consumer_attached(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/ep_engine.cc ``doDcpStats``: the ``ep_dcp_*`` totals
    are always there; ``eq_dcpq:<name>:*`` follow per connection."""
    _, port = await serve_upr_side(nursery, filled(16), side, tmp_path)
    totals = ["count", "producer_count", "items_remaining", "items_sent", "total_bytes"]
    with trio.fail_after(20):
        for group in (b"dcp", b"upr"):
            status, pairs = await stats(port, group)
            assert status == 0
            assert {f"ep_dcp_{t}": "0" for t in totals}.items() <= pairs.items()
        client = await producer(port, b"watcher")
        await client.send(dcp.stream_req(1, opaque=10))
        assert (await client.response(10)).status == 0
        status, pairs = await stats(port, b"dcp")
        assert pairs["ep_dcp_count"] == "1" and pairs["ep_dcp_producer_count"] == "1"
        assert pairs["eq_dcpq:watcher:type"] == "producer"
        await client.aclose()


async def test_stat_dcp_vbtakeover_under_its_3_0_names(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/ep_engine.cc ``getStats``: ``dcp-vbtakeover <vb>
    <name>`` (and ``upr-vbtakeover``) runs ``doDcpVbTakeoverStats``; our
    ``vbucket-takeover`` stays as an alias."""
    server, port = await serve_upr_side(nursery, filled(16), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"mover")
        await client.send(dcp.stream_req(1, opaque=10))
        assert (await client.response(10)).status == 0
        items = 0
        while items < high_seqno(server, 1):
            got = await client.next()
            assert got is not None
            items += got.opcode == dcp.MUTATION
        for group in (b"dcp-vbtakeover", b"upr-vbtakeover", b"vbucket-takeover"):
            status, pairs = await stats(port, group + b" 1 mover")
            assert status == 0, group
            assert pairs["estimate"] == "0" and pairs["status"] == "in-memory", group
        assert (await stats(port, b"dcp-vbtakeover 1 nobody"))[0] == KEY_ENOENT
        assert (await stats(port, b"dcp-vbtakeover one mover"))[0] == EINVAL
        assert (await stats(port, b"dcp-vbtakeover 1"))[0] == EINVAL
        await client.aclose()


async def test_stat_vbucket_names_each_vbucket_state(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/ep_engine.cc ``doVBucketStats``: ``vb_N`` and its
    state, which orchestrators read on the UPR port as well."""
    _, port = await serve_upr_side(nursery, filled(16), side, tmp_path)
    with trio.fail_after(20):
        status, pairs = await stats(port, b"vbucket")
        assert status == 0
        assert pairs == {f"vb_{vb}": "active" for vb in range(VBUCKETS)}


async def test_close_stream_response_is_the_end_of_the_stream(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/upr-producer.cc ``UprProducer::closeStream`` drops
    the stream from its map before ``setDead(END_STREAM_CLOSED)``, so the
    STREAM_END it queues is never sent (``getNextItem`` walks only the map):
    the CLOSE_STREAM response is the consumer's last word of that stream, and
    the vbucket can be requested again at once."""
    server, port = await serve_upr_side(nursery, filled(40), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"closer")
        await client.send(dcp.stream_req(1, opaque=10))
        assert (await client.response(10)).status == 0
        items = 0
        while items < high_seqno(server, 1):
            got = await client.next()
            assert got is not None
            items += got.opcode == dcp.MUTATION
        await client.send(dcp.close_stream(1, opaque=20), dcp.frame(dcp.MC_NOOP, opaque=21))
        seen: list[Reply] = []
        while not seen or (seen[-1].opcode, seen[-1].opaque) != (dcp.MC_NOOP, 21):
            got = await client.next()
            assert got is not None
            seen.append(got)
        assert [(m.opcode, m.status) for m in seen if m.opaque == 20] == [(dcp.CLOSE_STREAM, 0)]
        assert not [m for m in seen if m.opcode == dcp.STREAM_END]
        await client.send(dcp.stream_req(1, opaque=30, end=high_seqno(server, 1)))
        assert (await client.response(30)).status == 0
        again = await read_stream(client, 30)
        assert sum(m.opcode == dcp.MUTATION for m in again) == items
        await client.send(dcp.close_stream(1, opaque=31))  # ended: nothing to close
        assert (await client.response(31)).status == KEY_ENOENT
        await client.aclose()


async def test_takeover_markers_ask_for_acks_only_in_the_takeover_send_phase(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/upr-stream.cc: ``ActiveStream`` sets
    MARKER_FLAG_ACK on a snapshot marker only in ``takeoverSendPhase``, after
    the consumer took SET_VBUCKET_STATE(pending); the catch-up before it is
    not acked. Written while pending: sent in that phase, under an ACK marker."""
    store = filled(40)
    _, port = await serve_upr_side(nursery, store, side, tmp_path)
    with trio.fail_after(30):
        client = await producer(port, b"taker")

        def write() -> None:
            store.set(1, b"while-pending", b"x", now=time.time())

        seen = await take_over(client, 1, while_pending=write if side == "node" else None)
        await client.aclose()
    states = [m.extras for m in seen if m.opcode == dcp.SET_VBUCKET_STATE]
    assert states == [b"\x03", b"\x01"]  # pending, then active
    pending_at = next(i for i, m in enumerate(seen) if m.opcode == dcp.SET_VBUCKET_STATE)
    before = [m for m in seen[:pending_at] if m.opcode == dcp.MARKER]
    after = [m for m in seen[pending_at:] if m.opcode == dcp.MARKER]
    assert before and not [m for m in before if m.marker_flags & dcp.ACK]
    assert all(m.marker_flags & dcp.ACK for m in after)
    if side == "node":
        assert after and any(m.key == b"while-pending" for m in seen[pending_at:])
    assert struct.unpack(">I", seen[-1].extras)[0] == 0  # STREAM_END OK


async def test_stream_counters_while_flow_control_holds_the_stream(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/upr-stream.cc ``ActiveStream::addStats``:
    ``items_sent`` and ``last_sent_seqno`` count what went on the wire, and
    ``items_remaining`` what has not; a stream paused by the connection's
    buffer (upr-producer.cc ``BufferLog``) reports what it did send."""
    server, port = await serve_upr_side(nursery, filled(800), side, tmp_path)
    high = high_seqno(server, 1)
    with trio.fail_after(20):
        client = await producer(port, b"held")
        await client.send(dcp.control(b"connection_buffer_size", b"2000", opaque=2))
        assert (await client.response(2)).status == 0
        await client.send(dcp.stream_req(1, opaque=10, end=high))
        assert (await client.response(10)).status == 0
        got: list[Reply] = []
        while True:
            _, pairs = await stats(port, b"dcp")
            if sum(m.size for m in got) < int(pairs["eq_dcpq:held:total_bytes_sent"]):
                message = await client.next()
                assert message is not None
                got.append(message)
            elif pairs["eq_dcpq:held:paused"] == "true":
                break
            else:
                await trio.testing.wait_all_tasks_blocked(0.001)
        items = [m for m in got if m.opcode == dcp.MUTATION]
        assert 0 < len(items) < high
        assert pairs["eq_dcpq:held:stream_1_items_sent"] == str(len(items))
        assert pairs["eq_dcpq:held:stream_1_last_sent_seqno"] == str(items[-1].by_seqno)
        assert pairs["eq_dcpq:held:stream_1_items_remaining"] == str(high - items[-1].by_seqno)
        await client.aclose()


@pytest.mark.parametrize("flag", [dcp.LATEST, dcp.DISKONLY])
async def test_latest_and_diskonly_streams_end_at_what_exists_at_the_request(
    nursery: trio.Nursery, side: str, tmp_path: Path, flag: int
) -> None:
    """ep-engine v3.0.0 src/upr-producer.cc ``streamRequest`` / src/upr-stream.cc
    ``ActiveStream``: LATEST (0x04) takes the high seqno at the request as the
    end seqno, DISKONLY (0x02) the end of the disk snapshot (here everything
    is on disk); both then end with STREAM_END(OK), later writes not sent."""
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 1)
    with trio.fail_after(20):
        client = await producer(port, b"latest")
        await client.send(dcp.stream_req(1, opaque=10, flags=flag))
        assert (await client.response(10)).status == 0
        store.set(1, b"too-late", b"x", now=time.time())
        messages = await read_stream(client, 10)
        await client.aclose()
    items = [m for m in messages if m.opcode == dcp.MUTATION]
    assert items[-1].by_seqno == high and b"too-late" not in [m.key for m in items]
    assert struct.unpack(">I", messages[-1].extras)[0] == 0  # OK


async def test_commands_on_a_upr_stream_are_answered_between_its_messages(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """memcached v3.0.0 daemon/memcached.c: ``conn_ship_log`` runs every packet a
    UPR connection receives through ``try_read_command``; ``dispatch_bin_command``
    answers VERSION, NOOP (0x0a) and STAT as on any connection, and an opcode
    with no executor goes to the engine (``process_bin_unknown_packet``), whose
    ``processUnknownCommand`` (ep-engine src/ep_engine.cc) answers
    UNKNOWN_COMMAND; ``conn_set_state`` then sends the connection back to
    ``conn_ship_log``. So each reply comes whole between two stream messages,
    and the stream goes on."""
    store = filled(2000)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    expected = {0xA1: 0, 0xA2: 0, 0xA3: 0, 0xA4: 0x81}
    with trio.fail_after(30):
        client = await producer(port, b"asks")
        await client.send(dcp.stream_req(1, opaque=10))
        assert (await client.response(10)).status == 0
        await client.send(
            dcp.frame(0x0B, opaque=0xA1),  # VERSION
            dcp.stat(b"", opaque=0xA2),
            dcp.frame(dcp.MC_NOOP, opaque=0xA3),
            dcp.frame(0xEE, opaque=0xA4),  # nobody's opcode
        )
        replies: dict[int, list[Reply]] = {}
        seqnos: list[int] = []
        high = high_seqno(server, 1)
        later = False
        while not later or not seqnos or seqnos[-1] <= high:  # replies may all come first
            got = await client.next()
            assert got is not None, "the server closed the connection"
            if got.magic == dcp.RES:
                replies.setdefault(got.opaque, []).append(got)
            elif got.opcode == dcp.NOOP:
                await client.send(dcp.reply(got))
            elif got.opcode == dcp.MUTATION:
                seqnos.append(got.by_seqno)  # every stream message whole, in order
            if not later and set(replies) == set(expected) and replies[0xA2][-1].key == b"":
                later = True
                store.set(1, b"later", b"x", now=time.time())
        await client.aclose()
    assert {opaque: got[-1].status for opaque, got in replies.items()} == expected
    assert replies[0xA1][0].value  # the version text
    assert len(replies[0xA2]) > 1 and all(r.key for r in replies[0xA2][:-1])
    assert seqnos == sorted(seqnos) and len(seqnos) == 501
