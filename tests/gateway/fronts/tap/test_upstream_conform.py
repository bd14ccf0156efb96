"""The TAP front as the consumer of what a released 3.0 producer sends.

A scripted producer (tests/support/scripted_upr.py) plays what ep-engine
v3.0.0 sends and the reference node never does. Each test names the source
it follows: src/upr-stream.cc ``ActiveStream`` (``markDiskSnapshot``,
``nextCheckpointItem``, ``endStream``), src/upr-producer.cc
``UprProducer::step`` and ``vbucketStateChanged``, src/upr-response.h.

The clients set the CHECKPOINT flag, so snapshots reach them as checkpoints
(ep-engine 2.5.1 src/tapconnection.cc sends CHECKPOINT_START/END only when
``supportCheckpointSync_``, which that flag alone sets); a client without it
gets the items alone (``test_without_the_checkpoint_flag_items_come_alone``).
"""

from __future__ import annotations

import logging
import struct

import pytest
import trio

from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapEvent,
    TapMutation,
    TapNoop,
    TapOpaque,
)
from gateway.fronts.tap.server import TapFront
from gateway.metrics.figures import TAP_FRONT
from tests.support.fronts import tap_front_over_scripted
from tests.support.scripted_upr import (
    CHECKPOINT,
    DISK,
    MEMORY,
    Channel,
    Request,
    ScriptedUpr,
    deletion,
    expiration,
    marker,
    mutation,
    stream_end,
    stream_ok,
)
from tests.support.waiting import until

F = ConnectFlags
BACKFILL = F.LIST_VBUCKETS | F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT


def shape(events: list[TapEvent]) -> list[str]:
    """The stream as a list of short names: I/C for backfill open/close, S/E for
    checkpoint start/end, mN/dN for items (by key)."""
    out = []
    for event in events:
        if isinstance(event, TapOpaque):
            if event.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM:
                out.append("I")
            elif event.opaque_code == OpaqueCode.CLOSE_BACKFILL:
                out.append("C")
        elif isinstance(event, TapCheckpointStart):
            out.append("S")
        elif isinstance(event, TapCheckpointEnd):
            out.append("E")
        elif isinstance(event, TapMutation):
            out.append("m" + event.key.decode())
        elif isinstance(event, TapDelete):
            out.append("d" + event.key.decode())
    return out


async def run_client(
    nursery: trio.Nursery,
    upr: ScriptedUpr,
    connect_flags: ConnectFlags = BACKFILL,
    *,
    lost: bool = False,
    **kw: object,
) -> tuple[list[TapEvent], TapFront]:
    """What the client gets up to the close; with ``lost`` (the vbucket's stream
    ends other than OK, so the connection stays open, test_lost_vbucket_conform.py)
    up to a NOOP once it ended, the stream messages only."""
    if lost:
        kw.setdefault("noop_interval", 0.1)
    rig = await tap_front_over_scripted(nursery, upr, reconnect_attempts=2, **kw)
    front = rig.front
    backfill = 0 if connect_flags & F.BACKFILL else None
    with trio.fail_after(20):
        client = await rig.client(b"conform", connect_flags, backfill_date=backfill, vbuckets=(0,))
        if lost:
            ended = front.stats.stream_ends_total.values
            events = await client.collect(lambda e: isinstance(e, TapNoop) and sum(ended()) > 0)
            assert isinstance(events.pop(), TapNoop)  # open, idle
            events = [e for e in events if not isinstance(e, TapNoop)]
            await client.aclose()
        else:
            events = await client.collect()  # up to the close, acking as asked
    return events, front


async def test_every_snapshot_kind_of_a_3_0_producer(nursery: trio.Nursery) -> None:
    """A disk snapshot whose end no item reaches (deduplicated), then memory ones
    with and without CHECKPOINT, an empty one among them (src/upr-stream.cc
    ``markDiskSnapshot``, ``nextCheckpointItem``): one backfill, then one TAP
    checkpoint per marker, each closed before the next opens."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(
            stream_ok(req),
            marker(o, 0, 3, DISK),
            mutation(o, 1, b"1"),
            mutation(o, 2, b"2"),
            marker(o, 4, 5, MEMORY | CHECKPOINT),
            mutation(o, 4, b"4"),
            mutation(o, 5, b"5"),
            marker(o, 6, 6, MEMORY),  # empty
            marker(o, 7, 8, MEMORY),
            mutation(o, 7, b"7"),
            deletion(o, 8, b"8"),
            stream_end(o, 0),
        )

    events, _ = await run_client(nursery, ScriptedUpr(play))
    assert shape(events) == [
        *("I", "m1", "m2", "C"),
        *("S", "m4", "m5", "E"),
        *("S", "E"),
        *("S", "m7", "d8", "E"),
    ]


async def test_without_the_checkpoint_flag_items_come_alone(nursery: trio.Nursery) -> None:
    """The snapshots of ``test_every_snapshot_kind_of_a_3_0_producer`` to a client
    without the CHECKPOINT flag: the backfill keeps its OPAQUE brackets, the live
    items come alone, no OPAQUE(ENABLE_CHECKPOINT_SYNC) opens the stream
    (ep-engine 2.5.1 src/tapconnection.cc: ``TapProducer::evaluateFlags`` sets
    ``supportCheckpointSync_`` and queues that OPAQUE for the CHECKPOINT flag
    alone; ``nextFgFetched_UNLOCKED`` queues checkpoint messages only with it),
    and no checkpoint end is kept for a CHECKPOINT resume."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(
            stream_ok(req),
            marker(o, 0, 3, DISK),
            mutation(o, 1, b"1"),
            mutation(o, 2, b"2"),
            marker(o, 4, 5, MEMORY | CHECKPOINT),
            mutation(o, 4, b"4"),
            mutation(o, 5, b"5"),
            marker(o, 6, 6, MEMORY),  # empty
            marker(o, 7, 8, MEMORY),
            mutation(o, 7, b"7"),
            deletion(o, 8, b"8"),
            stream_end(o, 0),
        )

    flags = F.LIST_VBUCKETS | F.BACKFILL | F.SUPPORT_ACK
    events, front = await run_client(nursery, ScriptedUpr(play), flags)
    assert shape(events) == ["I", "m1", "m2", "C", "m4", "m5", "m7", "d8"]
    assert not any(isinstance(e, TapCheckpointStart | TapCheckpointEnd) for e in events)
    codes = [e.opaque_code for e in events if isinstance(e, TapOpaque)]
    assert OpaqueCode.ENABLE_CHECKPOINT_SYNC not in codes
    assert front.registry.checkpoint_ends() == {}


async def test_an_empty_disk_snapshot_is_an_empty_backfill(nursery: trio.Nursery) -> None:
    """A disk snapshot every item of which was deleted and purged since (src/
    upr-stream.cc ``markDiskSnapshot`` marks the range the backfill read, items
    or none): the TAP client still gets its backfill, empty, then the
    checkpoints."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(
            stream_ok(req),
            marker(o, 0, 7, DISK),
            marker(o, 8, 8, MEMORY | CHECKPOINT),
            mutation(o, 8, b"8"),
            stream_end(o, 0),
        )

    events, _ = await run_client(nursery, ScriptedUpr(play))
    assert shape(events) == ["I", "C", "S", "m8", "E"]


async def test_items_with_metadata_lock_time_and_expirations(nursery: trio.Nursery) -> None:
    """3.0's item layouts (src/upr-response.h ``MutationResponse``, memcached
    v3.0.0 protocol_binary.h ``protocol_binary_request_upr_mutation``: nmeta
    bytes of metadata after the value; DELETION and EXPIRATION with 18 bytes
    of extras): the metadata is not part of the TAP value, an expiration is a
    TAP DELETE."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(
            stream_ok(req),
            marker(o, 0, 4, DISK),
            mutation(o, 1, b"a", b"value-a", meta=b"\x01\x00\x04\x00\x00\x00\x01", lock_time=15),
            deletion(o, 2, b"b", meta=b"\x01\x00\x04\x00\x00\x00\x02"),
            expiration(o, 3, b"c"),
            mutation(o, 4, b"d", b"", meta=b"\x01\x00\x04\x00\x00\x00\x03"),
            stream_end(o, 0),
        )

    events, _ = await run_client(nursery, ScriptedUpr(play))
    assert shape(events) == ["I", "ma", "db", "dc", "md", "C"]
    values = {e.key: e.value for e in events if isinstance(e, TapMutation)}
    assert values == {b"a": b"value-a", b"d": b""}


async def test_a_first_marker_that_starts_below_the_stream_start(nursery: trio.Nursery) -> None:
    """A live-only stream starts at the high seqno; 3.0's first memory marker
    starts at the request's snap_start (src/upr-stream.cc ``nextCheckpointItem``:
    ``isFirstSnapshot``) and a disk one at min(snap_start, start)
    (``markDiskSnapshot``), so the range may start below the stream start."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        # With the uuid STAT vbucket-seqno gave: a uuid the producer's failover
        # log lacks means a rollback to 0 (src/failover-table.cc ``needsRollback``).
        assert (req.start, req.uuid, req.snap_start, req.snap_end) == (100, 0xABC, 100, 100)
        await channel.send(
            stream_ok(req),
            marker(o, 90, 102, MEMORY),
            mutation(o, 101, b"x"),
            mutation(o, 102, b"y"),
            stream_end(o, 0),
        )

    flags = F.LIST_VBUCKETS | F.SUPPORT_ACK | F.CHECKPOINT
    events, _ = await run_client(nursery, ScriptedUpr(play), flags)
    assert shape(events) == ["S", "mx", "my", "E"]


@pytest.mark.parametrize(
    ("reason", "name"),
    [(0, "ok"), (1, "closed"), (2, "state_changed"), (3, "disconnected"), (4, "too_slow")],
)
async def test_stream_end_of_each_reason_ends_the_vbucket(
    nursery: trio.Nursery, reason: int, name: str
) -> None:
    """STREAM_END ends the vbucket whatever its reason (src/upr-stream.cc
    ``ActiveStream::endStream``; STATE_CHANGED is what ``UprProducer::
    vbucketStateChanged`` sends when the vbucket stops being active): the open
    checkpoint is closed. With every vbucket ended the TAP connection closes
    after OK (the stream was served to its end) and stays open, idle, after any
    other reason (a lost vbucket: test_lost_vbucket_conform.py). After
    STATE_CHANGED the stream is requested again (test_vbucket_comes_back_conform.py);
    here the vbucket is gone by then (NOT_MY_VBUCKET)."""
    from tests.support.raw_dcp import RES, STREAM_REQ, frame

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        if req.start:  # requested again after STATE_CHANGED: deleted meanwhile
            await channel.send(frame(STREAM_REQ, magic=RES, vbucket=0x07, opaque=o))
            return
        await channel.send(
            stream_ok(req),
            marker(o, 0, 2, DISK),
            mutation(o, 1, b"1"),
            marker(o, 3, 9, MEMORY),
            mutation(o, 3, b"3"),
            stream_end(o, reason),
        )

    events, front = await run_client(nursery, ScriptedUpr(play), lost=reason != 0)
    assert shape(events) == ["I", "m1", "C", "S", "m3", "E"]
    assert front.stats.stream_ends_total[TAP_FRONT, name] == 1


@pytest.mark.parametrize("status", [0x07, 0x22, 0x02])
async def test_a_refused_stream_request_ends_the_vbucket(
    nursery: trio.Nursery, status: int
) -> None:
    """NOT_MY_VBUCKET, ERANGE, KEY_EEXISTS: what src/upr-producer.cc
    ``UprProducer::streamRequest`` answers for a vbucket it lacks, a start
    above the end, a stream already open."""
    from tests.support.raw_dcp import RES, STREAM_REQ, frame

    async def play(channel: Channel, req: Request) -> None:
        await channel.send(frame(STREAM_REQ, magic=RES, vbucket=status, opaque=req.opaque))

    events, front = await run_client(nursery, ScriptedUpr(play), lost=True)
    assert shape(events) == []
    ends = front.stats.stream_ends_total
    assert ends[TAP_FRONT, f"refused_0x{status:02x}"] == 1


# -- what no 3.0 producer sends: one line, the upstream closed, the TAP peer told --


def bad_mutation(opaque: int, seqno: int, key: bytes) -> bytes:
    """A MUTATION with 30 bytes of extras (3.0's are 31)."""
    from tests.support.raw_dcp import MUTATION, frame

    extras = struct.pack(">QQIIIH", seqno, 1, 0, 0, 0, 0)
    return frame(MUTATION, extras=extras, key=key, value=b"v", opaque=opaque)


def unknown_request(opaque: int) -> bytes:
    from tests.support.raw_dcp import frame

    return frame(0x5F, extras=b"\x00\x00\x00\x00", opaque=opaque)


@pytest.mark.parametrize("bad", ["extras", "opcode", "opcode_other_opaque"])
async def test_a_malformed_message_closes_upstream_and_tap_peer(
    nursery: trio.Nursery, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing after a message a 3.0 producer never sends reaches the TAP peer:
    one error line names the opcode, field and value, the upstream connection is
    closed (not reconnected to play the same bytes again), and the TAP peer
    sees its connection close once what came before is delivered, as a 2.x
    producer's client saw a lost source."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        if bad == "extras":
            broken = bad_mutation(o, 2, b"2")
        elif bad == "opcode":
            broken = unknown_request(o)
        else:
            broken = unknown_request(o + 1000)
        await channel.send(
            stream_ok(req),
            marker(o, 0, 9, DISK),
            mutation(o, 1, b"1"),
            broken,
            mutation(o, 3, b"3"),
            mutation(o, 4, b"4"),
        )

    upr = ScriptedUpr(play)
    events, front = await run_client(nursery, upr)
    assert "m3" not in shape(events) and "m4" not in shape(events)
    assert shape(events)[:2] == ["I", "m1"]
    assert upr.connections == 1
    assert front.stats.protocol_errors_total[TAP_FRONT, "upstream_malformed"] == 1
    with trio.fail_after(10):
        await until(lambda: upr.closed == 1)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "0x" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    assert "opcode=0x57" in errors[0].getMessage() or "opcode=0x5f" in errors[0].getMessage()


async def test_a_large_item_after_small_ones_is_not_stalled_by_held_back_acks(
    nursery: trio.Nursery,
) -> None:
    """A 3.0 producer holds a message that does not fit in what is left of the
    buffer (v3.0.0 src/upr-producer.cc ``BufferLog::insert``), and a 3.0 consumer
    returns what it freed after a fifth of the buffer or on a timer
    (src/upr-consumer.cc ``handleFlowCtl``). A message larger than four fifths
    of the buffer, after a few small ones all acked by the TAP peer, must not
    wait forever for an ack held back below the fifth."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(stream_ok(req))
        await channel.send_counted(
            marker(o, 0, 3, DISK),
            mutation(o, 1, b"1"),
            mutation(o, 2, b"2", b"x" * 900),
            mutation(o, 3, b"3"),
            stream_end(o, 0),
        )

    upr = ScriptedUpr(play)
    events, _ = await run_client(nursery, upr, buffer_size=1000)
    assert shape(events) == ["I", "m1", "m2", "m3", "C"]


async def test_a_backfill_from_zero_served_from_memory_is_still_a_backfill(
    nursery: trio.Nursery,
) -> None:
    """A 3.0 producer serves a stream from 0 straight from memory when the
    checkpoints still hold seqno 1 on (v3.0.0 src/upr-stream.cc
    ``ActiveStream::scheduleBackfill``: no backfill task when ``backfillStart``
    is not below the cursor's seqno; ``nextCheckpointItem`` then sends a MEMORY
    marker first). The TAP client asked for a backfill, and a 2.x server wraps a
    backfill in OPAQUE(INITIAL_VBUCKET_STREAM) ... OPAQUE(CLOSE_BACKFILL) (2.5.1
    src/tapconnection.cc ``TapProducer::scheduleBackfill_UNLOCKED``): the
    receiver resets the vbucket on the first, so the first snapshot must be
    wrapped so whatever its flags."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(
            stream_ok(req),
            marker(o, 0, 3, MEMORY),
            mutation(o, 1, b"1"),
            mutation(o, 2, b"2"),
            mutation(o, 3, b"3"),
            marker(o, 4, 5, MEMORY | CHECKPOINT),
            mutation(o, 4, b"4"),
            mutation(o, 5, b"5"),
            stream_end(o, 0),
        )

    events, _ = await run_client(nursery, ScriptedUpr(play))
    assert shape(events) == ["I", "m1", "m2", "m3", "C", "S", "m4", "m5", "E"]


async def test_noops_are_answered_at_once(nursery: trio.Nursery) -> None:
    """A 3.0 producer with ``enable_noop`` sends NOOP requests and drops a
    consumer that does not answer (v3.0.0 src/upr-producer.cc
    ``maybeSendNoop``/``handleResponse``): the answer has the request's opaque,
    status 0, and goes while items of the stream wait for the TAP peer."""
    from tests.support.raw_dcp import NOOP, frame

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(
            stream_ok(req),
            marker(o, 0, 2, DISK),
            mutation(o, 1, b"1"),
            frame(NOOP, opaque=0xBEEF),
        )
        with trio.fail_after(10):
            await until(lambda: bool(channel.upr.replies(NOOP)))
        await channel.send(mutation(o, 2, b"2"), stream_end(o, 0))

    upr = ScriptedUpr(play)
    events, _ = await run_client(nursery, upr)
    assert shape(events) == ["I", "m1", "m2", "C"]
    (answer,) = upr.replies(NOOP)
    assert (answer.opaque, answer.status, answer.extras, answer.value) == (0xBEEF, 0, b"", b"")


async def test_a_resume_asks_from_the_last_seqno_in_its_snapshot_with_the_newest_uuid(
    nursery: trio.Nursery,
) -> None:
    """After the upstream connection is lost, the stream is asked again as a 3.0
    consumer asks it (v3.0.0 src/upr-stream.cc ``PassiveStream``, src/
    failover-table.cc ``needsRollback``): from the last seqno received, with the
    uuid of the newest failover entry of the STREAM_REQ answer (a log of 25
    entries, the most 3.0 keeps) and the range of the snapshot it is in; the
    producer's second disk marker starts at that snapshot's start
    (``markDiskSnapshot``: min(snap_start, start)) and the TAP peer sees one
    unbroken backfill."""
    failover = tuple((0x1000 + i, 1000 - 40 * i) for i in range(25))

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        if len(channel.upr.requests) == 1:
            await channel.send(
                stream_ok(req, failover),
                marker(o, 0, 10, DISK),
                *(mutation(o, s, b"%d" % s) for s in range(1, 5)),
            )
            await channel.stream.aclose()
            return
        await channel.send(
            stream_ok(req, failover),
            marker(o, 0, 10, DISK),
            *(mutation(o, s, b"%d" % s) for s in range(5, 11)),
            marker(o, 11, 11, MEMORY | CHECKPOINT),
            mutation(o, 11, b"11"),
            stream_end(o, 0),
        )

    upr = ScriptedUpr(play)
    events, _ = await run_client(nursery, upr)
    assert shape(events) == ["I", *(f"m{s}" for s in range(1, 11)), "C", "S", "m11", "E"]
    first, again = upr.requests
    assert (first.start, first.uuid, first.snap_start, first.snap_end) == (0, 0, 0, 0)
    assert (again.start, again.uuid, again.snap_start, again.snap_end) == (4, 0x1000, 0, 10)
    assert again.end == first.end


async def test_a_rollback_answer_restarts_the_vbucket_from_zero(nursery: trio.Nursery) -> None:
    """3.0's rollback answer: status 0x23 and the seqno as an 8-byte value, no
    extras (v3.0.0 memcached daemon/memcached.c ``upr_stream_req_executor``,
    ep-engine src/upr-producer.cc ``streamRequest``). The TAP client cannot roll
    back part of a vbucket: it gets a new OPAQUE(INITIAL_VBUCKET_STREAM) and the
    whole vbucket again, asked from 0 with uuid 0."""
    from tests.support.raw_dcp import RES, STREAM_REQ, frame

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        n = len(channel.upr.requests)
        if n == 1:
            await channel.send(
                stream_ok(req), marker(o, 0, 10, DISK), *(mutation(o, s, b"%d" % s) for s in (1, 2))
            )
            await channel.stream.aclose()
        elif n == 2:
            value = struct.pack(">Q", 1)
            await channel.send(frame(STREAM_REQ, magic=RES, vbucket=0x23, value=value, opaque=o))
        else:
            await channel.send(
                stream_ok(req),
                marker(o, 0, 3, DISK),
                *(mutation(o, s, b"x%d" % s) for s in (1, 2, 3)),
                stream_end(o, 0),
            )

    upr = ScriptedUpr(play)
    events, front = await run_client(nursery, upr)
    assert shape(events) == ["I", "m1", "m2", "C", "I", "mx1", "mx2", "mx3", "C"]
    assert [(r.start, r.uuid, r.snap_start, r.snap_end) for r in upr.requests[1:]] == [
        (2, 0xABC, 0, 10),
        (0, 0, 0, 0),
    ]
    assert front.stats.rollbacks_total[TAP_FRONT] == 1


async def test_a_flush_closes_both_connections(nursery: trio.Nursery) -> None:
    """A 3.0 producer sends no FLUSH on a stream (src/upr-producer.cc
    ``UprProducer::step`` has no case for it), and a TAP client cannot be told
    to flush one vbucket: nothing after it reaches the TAP peer."""
    from tests.support.raw_dcp import frame

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        await channel.send(
            stream_ok(req),
            marker(o, 0, 3, DISK),
            mutation(o, 1, b"1"),
            mutation(o, 2, b"2"),
            frame(0x5A, opaque=o),
            mutation(o, 3, b"3"),
        )

    upr = ScriptedUpr(play)
    events, front = await run_client(nursery, upr)
    assert shape(events)[:3] == ["I", "m1", "m2"] and "m3" not in shape(events)
    assert front.stats.protocol_errors_total[TAP_FRONT, "upstream_malformed"] == 1
    assert upr.connections == 1


@pytest.mark.parametrize("stray", ["after_stream_end", "other_opaque"])
async def test_a_message_for_no_live_stream_is_dropped_with_enoent(
    nursery: trio.Nursery, stray: str
) -> None:
    """Nothing follows STREAM_END on its opaque (src/upr-stream.cc ``endStream``),
    and every message of a stream carries its opaque. A 3.0 consumer answers a
    message for no live stream KEY_ENOENT and goes on (src/upr-consumer.cc
    ``UprConsumer::mutation`` and the others; the producer ignores the answer,
    src/upr-producer.cc ``handleResponse``): the TAP peer never sees it, the
    other vbucket streams on, and its buffer bytes come back."""
    from tests.support.raw_dcp import MUTATION, RES

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        if req.vbucket == 1:
            tail = [mutation(o, 3, b"3"), stream_end(o, 0)]
        elif stray == "after_stream_end":
            tail = [stream_end(o, 0), mutation(o, 3, b"x3")]
        else:
            tail = [mutation(o + 1000, 3, b"x3"), mutation(o, 3, b"3"), stream_end(o, 0)]
        await channel.send(
            stream_ok(req), marker(o, 0, 3, DISK), mutation(o, 1, b"1"), mutation(o, 2, b"2"), *tail
        )

    upr = ScriptedUpr(play, vbuckets={0: (0xABC, 100), 1: (0xABD, 100)})
    rig = await tap_front_over_scripted(nursery, upr, reconnect_attempts=2)
    with trio.fail_after(20):
        client = await rig.client(b"conform", BACKFILL, backfill_date=0, vbuckets=(0, 1))
        events = await client.collect()
    assert "mx3" not in shape(events)
    assert sorted(shape(events)).count("m3") == (1 if stray == "after_stream_end" else 2)
    assert rig.front.stats.protocol_errors_total[TAP_FRONT, "upstream_stray"] == 1
    assert rig.front.stats.protocol_errors_total[TAP_FRONT, "upstream_malformed"] == 0
    (answer,) = [r for r in upr.received if r.magic == RES and r.opcode == MUTATION]
    (vb0,) = [r for r in upr.requests if r.vbucket == 0]
    expected = vb0.opaque if stray == "after_stream_end" else vb0.opaque + 1000
    assert (answer.status, answer.opaque) == (0x01, expected)
    assert upr.connections == 1


@pytest.mark.parametrize("bad", ["magic", "oversize"])
async def test_a_frame_that_cannot_be_framed_closes_both_connections(
    nursery: trio.Nursery, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A header with a magic that is neither request nor response, or a body
    longer than any frame the gateway accepts: memcached v3.0.0 daemon/memcached.c
    (``try_read_command``) closes such a connection. The line says the upstream
    sent it, so the TAP client is not blamed."""

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        if bad == "magic":
            broken = b"\x82" + mutation(o, 2, b"2")[1:]
        else:
            broken = struct.pack(">BBHBBHIIQ", 0x80, 0x57, 1, 31, 0, 0, 0x7FFFFFFF, o, 0)
        await channel.send(stream_ok(req), marker(o, 0, 9, DISK), mutation(o, 1, b"1"), broken)

    upr = ScriptedUpr(play)
    events, front = await run_client(nursery, upr)
    assert shape(events)[:2] == ["I", "m1"]
    assert upr.connections == 1
    assert front.stats.protocol_errors_total[TAP_FRONT, "upstream_malformed"] == 1
    lines = [r.getMessage() for r in caplog.records if "closing connection" in r.getMessage()]
    assert len(lines) == 1 and "UPR upstream" in lines[0], lines
