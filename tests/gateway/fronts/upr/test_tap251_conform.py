"""The UPR front's ingest as the TAP consumer of an ep-engine 2.5.1 producer.

A scripted producer (``tests.support.tap251``) sends what 2.5.1 sends, in the
order it sends it (ep-engine 2.5.1 src/tapconnection.cc and src/ep_engine.cc
``doWalkTapQueue``, memcached 2.5 daemon/memcached.c ``ship_tap_log``):

- ENABLE_AUTO_NACK and ENABLE_CHECKPOINT_SYNC on vbucket 0 whatever the
  vbucket list (``TapProducer::evaluateFlags``; ``nextVBucketHighPriority``
  does not filter them), then every listed vbucket's
  OPAQUE(INITIAL_VBUCKET_STREAM) back to back (``scheduleBackfill_UNLOCKED``),
  the backfill items of all of them interleaved, and only once the whole
  backfill is acked each vbucket's OPAQUE(CLOSE_BACKFILL)
  (``checkBackfillCompletion_UNLOCKED``); then checkpoints;
- with support-ack it sends nothing after an OPAQUE or a checkpoint message
  until that is acked (``waitForOpaqueMsgAck``, ``waitForCheckpointMsgAck``),
  and asks for an ack on the last item of a checkpoint and whenever its queue
  runs empty (``requestAck``): a consumer that holds those acks stalls it;
- an idle connection gets memcached NOOPs (opaque 0, no body), whose answer
  memcached ignores (``process_bin_noop_response``).

The consumer's side, as a 2.5.1 node's own consumer answers
(daemon/memcached.c ``process_bin_tap_packet``): a response (same opcode, the
message's opaque as sequence number, status 0) only to a message that asked
for one, once applied.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import trio

from adapters import upr
from tests.gateway.fronts.upr.support import UprClient, start_front, until
from tests.support import tap251 as t
from tests.support.fronts import items_of, served_items, upr_front_over_251
from tests.support.tap251 import (
    CLOSE_BACKFILL,
    CLOSE_TAP_STREAM,
    COMPLETE_VB_FILTER_CHANGE,
    ENABLE_AUTO_NACK,
    ENABLE_CHECKPOINT_SYNC,
    INITIAL_VBUCKET_STREAM,
    OPEN_CHECKPOINT,
    STREAMED,
    Session,
    Tap251Node,
    backfill,
)

NOW_EXPIRED = 1_000_000  # an expiration long past


@pytest.mark.parametrize("events", [False, True], ids=["fast", "events"])
@pytest.mark.parametrize("fsync", ["batch", "always", "never"])
async def test_a_251_session_is_logged_and_acked_as_251_waits_for_it(
    nursery: trio.Nursery, tmp_path: Path, fsync: str, events: bool
) -> None:
    """``events``: with a capture, every frame takes the event path."""
    done = trio.Event()
    items = {vb: [(b"k%d-%d" % (vb, i), b"v%d-%d" % (vb, i)) for i in range(3)] for vb in STREAMED}

    async def play(s: Session) -> None:
        await backfill(s, items)
        start = s.next()
        await s.send(t.checkpoint(t.CHECKPOINT_START, 1, 5, seqno=start, max_deleted_rev=3))
        await s.wait_ack(start)
        await s.send_acked(
            t.mutation(1, b"live", b"x", seqno=s.next(), cas=500, rev_seqno=2),
            t.noop(),
            t.delete(1, b"k1-0", seqno=s.next(), cas=501, rev_seqno=2, value=b"old", ack=True),
        )
        end = s.next()
        await s.send(t.checkpoint(t.CHECKPOINT_END, 1, 5, seqno=end))
        await s.wait_ack(end)
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        capture = {"capture_dir": tmp_path / "capture"} if events else {}
        front, port = await upr_front_over_251(
            nursery, tmp_path / "state", node, fsync=fsync, **capture
        )
        assert (front.ingest.recording is not None) == events
        await done.wait()
        session = node.sessions[0]
        vb1 = await served_items(port, 1, 5)
        vb2 = await served_items(port, 2, 3)
    # The CONNECT 2.5.1 reads (ep_engine.cc createTapQueue).
    assert session.connect.name == front.config.tap_name.encode()
    # Answered: exactly the messages that asked, with their opcode and opaque, status 0,
    # and the NOOP (opaque 0).
    asked = [r for r in session.responses if r.opcode != t.NOOP]
    assert all(r.status == 0 and r.body == b"" for r in session.responses)
    assert [r.opaque for r in asked] == sorted(r.opaque for r in asked)
    assert [r for r in session.responses if r.opcode == t.NOOP] == [t.Response(t.NOOP, 0, 0, b"")]
    got = items_of(vb1)
    assert [(e.key, e.value, e.flags) for e in got[:3] if isinstance(e, upr.Mutation)] == [
        (k, v, 0x01020304) for k, v in items[1]
    ]
    assert isinstance(got[3], upr.Mutation) and (got[3].key, got[3].rev_seqno) == (b"live", 2)
    assert isinstance(got[4], upr.Deletion) and (got[4].key, got[4].rev_seqno) == (b"k1-0", 2)
    assert [e.key for e in items_of(vb2)] == [k for k, _ in items[2]]
    assert 0 not in front.logs.logs  # the connection-wide OPAQUEs opened no log


async def test_a_flush_deletes_every_vbucket_it_streams(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """2.5.1 sends TAP_FLUSH on vbucket 0 for a flush of the whole bucket
    (tapconnmap.cc ``addFlushEvent``, ep_engine.cc ``doWalkTapQueue``), and its
    consumer flushes the whole bucket (ep_engine.cc ``tapNotify``: ``flush(cookie, 0)``)."""
    done = trio.Event()
    items = {vb: [(b"k%d-%d" % (vb, i), b"v") for i in range(2)] for vb in STREAMED}

    async def play(s: Session) -> None:
        await backfill(s, items)
        await s.send_acked(t.flush(seqno=s.next()))
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        front, port = await upr_front_over_251(nursery, tmp_path, node)
        await done.wait()
        streamed = {vb: items_of(await served_items(port, vb, 4)) for vb in STREAMED}
    for vb in STREAMED:
        assert [type(e) for e in streamed[vb]] == [upr.Mutation] * 2 + [upr.Deletion] * 2, vb
        assert {e.key for e in streamed[vb][2:]} == {k for k, _ in items[vb]}
    assert 0 not in front.logs.logs


async def test_every_opaque_command_is_acked_and_changes_no_history(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """2.5.1's consumer acts on INITIAL_VBUCKET_STREAM only; OPEN_CHECKPOINT (sent
    to a client of closed checkpoints only), COMPLETE_VB_FILTER_CHANGE (vbucket 0,
    after CHANGE_VBUCKET_FILTER: tapconnection.cc ``setVBucketFilter``),
    CLOSE_TAP_STREAM (the mover's) and a code it does not know are acked as
    applied (ep_engine.cc ``tapNotify``: "Received an unknown opaque command")."""
    done = trio.Event()
    items = {vb: [(b"k%d" % vb, b"v")] for vb in STREAMED}
    codes = [(1, OPEN_CHECKPOINT), (0, COMPLETE_VB_FILTER_CHANGE), (2, CLOSE_TAP_STREAM),
             (1, 5), (0, 0xFFFF)]  # fmt: skip

    async def play(s: Session) -> None:
        await backfill(s, items)
        for vb, code in codes:
            await s.send_acked(t.opaque(vb, code, seqno=s.next()))
        await s.send_acked(t.mutation(1, b"after", b"x", seqno=s.next(), cas=9, ack=True))
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        front, port = await upr_front_over_251(nursery, tmp_path, node)
        await done.wait()
        got = items_of(await served_items(port, 1, 2))
    assert [(e.key, e.by_seqno) for e in got] == [(b"k1", 1), (b"after", 2)]
    assert front.logs.logs[2].high_seqno == 1
    assert 0 not in front.logs.logs
    assert all(r.status == 0 for r in node.sessions[0].responses)


def _cut(frame: bytes, n: int) -> bytes:
    """``frame`` without its last ``n`` body bytes."""
    body = int.from_bytes(frame[8:12], "big") - n
    return frame[:8] + body.to_bytes(4, "big") + frame[12 : 24 + body]


def _patched(frame: bytes, at: int, raw: bytes) -> bytes:
    return frame[:at] + raw + frame[at + len(raw) :]


# What 2.5.1's consumer does with each is in its comment (ep_engine.cc ``tapNotify``,
# daemon/memcached.c ``process_bin_tap_packet``): ours logs one line and reconnects.
BAD = {
    # "Received an invalid vbucket state, diconnecting"
    "vbucket state 7": (t.vbucket_set(1, 7, seqno=900), ("opcode=0x45", "field=state", "value=7")),
    # "Received TAP_VBUCKET_SET with illegal size. Force disconnect"
    "vbucket state in 0 engine-specific bytes": (
        _patched(t.vbucket_set(1, 1, seqno=900), 24, b"\x00\x00"),
        ("opcode=0x45", "field=engine_specific_length", "value=0"),
    ),
    # "Checkpoint Id is missing in CHECKPOINT messages." (disconnect)
    "checkpoint without its id": (
        _cut(t.checkpoint(t.CHECKPOINT_START, 1, 6, seqno=900), 8),
        ("opcode=0x46", "field=checkpoint_id", "value=0"),
    ),
    # memcached reads the key past the body: undefined there
    "engine-specific length past the body": (
        _patched(t.mutation(1, b"bad", b"v", seqno=900, cas=1), 24, b"\xff\xff"),
        ("opcode=0x41", "field=engine_specific_length", "value=65535"),
    ),
    # (an unknown request opcode is answered and the stream goes on, as 2.x did:
    # test_ingest_unknown_opcode_conform.py)
    # not a packet: memcached closes the connection (``try_read_command``)
    "bad magic": (bytes([0x42, 0x41]) + bytes(22), ("opcode=0x41", "field=magic", "value=66")),
    "body over the frame limit": (
        _patched(t.noop(), 8, b"\xff\xff\xff\xff"),
        ("opcode=0x0a", "field=total_body", "value=4294967295"),
    ),
    # an error response where the producer never answers: the upstream refuses the stream
    "error response": (
        bytes([0x81, 0x41, 0, 0, 0, 0, 0, 0x84]) + (4).to_bytes(4, "big") + bytes(12) + b"fail",
        ("0x84", "MUTATION", "fail"),
    ),
}


@pytest.mark.parametrize("bad", list(BAD))
async def test_bad_input_closes_the_ingest_connection_with_one_line_and_harms_no_consumer(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: str
) -> None:
    """The frame before the bad one in the same read is not acked with it; the
    reconnected session sends it again (2.5.1 ``TapProducer::rollback`` resends
    what was unacked) and the consumer sees it once."""
    frame, words = BAD[bad]
    backfilled, done = trio.Event(), trio.Event()
    items = {vb: [(b"k%d" % vb, b"v")] for vb in STREAMED}

    def good(s: Session) -> bytes:
        return t.mutation(1, b"good", b"g", seqno=s.next(), cas=7, rev_seqno=2, ack=True)

    async def play(s: Session) -> None:
        if len(node.sessions) == 1:
            await backfill(s, items)
            backfilled.set()
            before = good(s)
            await s.send(before + frame)
            await s.closed.wait()
            return
        await s.send_acked(good(s), t.mutation(1, b"after", b"a", seqno=s.next(), cas=8, ack=True))
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        _, port = await upr_front_over_251(nursery, tmp_path, node)
        await backfilled.wait()
        client = await UprClient.connect(port)
        try:
            assert (await client.open(b"watcher")).status == 0
            assert (await client.stream_request(1)).status == 0
            await done.wait()
            got: list[upr.UprEvent] = []
            while len(items_of(got)) < 3:
                event = await client.receive()
                await client.answer(event)
                got.append(event)
        finally:
            await client.aclose()
    assert [e.key for e in items_of(got)] == [b"k1", b"good", b"after"]
    first = node.sessions[0]
    assert 900 not in {r.opaque for r in first.responses}
    assert len(node.sessions) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    named = [m for m in lines if all(w in m for w in words)]
    assert len(named) == 1, lines


async def test_the_reconnect_names_the_last_closed_checkpoints_2_5_1_resumes_after(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The CONNECT as 2.5.1's ep_engine.cc ``createTapQueue`` reads it: flags
    backfill, list vbuckets, support ack, checkpoint, registered client and fix
    flag byte order; backfill date 0 (everything, when the checkpoint asked for is
    gone: tapconnection.cc ``registerCursor``); the vbucket list; the map of last
    closed checkpoints (a vbucket with none left out, so the registered cursor
    resumes it); no closed-checkpoint-only byte (no OPEN_CHECKPOINT wanted). The
    producer then resumes vbucket 1 at checkpoint 6, with no new backfill."""
    done = trio.Event()
    items = {vb: [(b"k%d" % vb, b"v")] for vb in STREAMED}

    async def play(s: Session) -> None:
        if len(node.sessions) == 1:
            await backfill(s, items)
            await s.send_acked(t.checkpoint(t.CHECKPOINT_START, 1, 5, seqno=s.next()))
            await s.send_acked(t.mutation(1, b"in-5", b"x", seqno=s.next(), cas=50, ack=True))
            await s.send_acked(t.checkpoint(t.CHECKPOINT_END, 1, 5, seqno=s.next()))
            await s.stream.aclose()  # the node restarts
            return
        for code in (ENABLE_AUTO_NACK, ENABLE_CHECKPOINT_SYNC):
            await s.send(t.opaque(0, code, seqno=s.next()))
        await s.wait_ack(s.seqno)
        await s.send_acked(t.checkpoint(t.CHECKPOINT_START, 1, 6, seqno=s.next()))
        await s.send_acked(t.mutation(1, b"in-6", b"y", seqno=s.next(), cas=60, ack=True))
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        _, port = await upr_front_over_251(nursery, tmp_path, node)
        await done.wait()
        got = items_of(await served_items(port, 1, 3))
    connect = node.sessions[1].connect
    assert connect.flags == 0x01 | 0x04 | 0x10 | 0x40 | 0x80 | 0x100
    vbuckets = struct.pack(">HHH", 2, *STREAMED)
    assert connect.value == struct.pack(">Q", 0) + vbuckets + struct.pack(">HHQ", 1, 1, 5)
    assert [(e.key, e.by_seqno) for e in got] == [(b"k1", 1), (b"in-5", 2), (b"in-6", 3)]


async def test_a_second_interleaved_backfill_reconciles_each_vbucket(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A 2.5.1 node that lost the registered cursor (a restart: tapconnection.cc
    ``registerCursor`` finds no checkpoint to resume) backfills every vbucket
    again, interleaved, and closes each backfill only once all of it is acked:
    each vbucket's unchanged keys keep their seqnos, a changed one gets a new
    seqno, and a key the backfill no longer holds becomes a deletion at its
    CLOSE_BACKFILL."""
    done = trio.Event()
    first = {1: [(b"a", b"1"), (b"b", b"1")], 2: [(b"c", b"1"), (b"d", b"1")]}
    second = {1: [(b"a", b"1"), (b"b", b"2")], 2: [(b"c", b"1")]}

    async def play(s: Session) -> None:
        if len(node.sessions) == 1:
            await backfill(s, first)
            await s.stream.aclose()
            return
        # The same cas for an unchanged key: the backfill sends each key's cas.
        await backfill(s, second)
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        _, port = await upr_front_over_251(nursery, tmp_path, node)
        await done.wait()
        vb1 = items_of(await served_items(port, 1, 3))
        vb2 = items_of(await served_items(port, 2, 3))
    assert [(type(e), e.key, e.by_seqno) for e in vb1] == [
        (upr.Mutation, b"a", 1), (upr.Mutation, b"b", 2), (upr.Mutation, b"b", 3)
    ]  # fmt: skip
    assert [(type(e), e.key, e.by_seqno) for e in vb2] == [
        (upr.Mutation, b"c", 1), (upr.Mutation, b"d", 2), (upr.Deletion, b"d", 3)
    ]  # fmt: skip


def checkpoint_map(connect: t.Connect) -> dict[int, int]:
    """The CONNECT's map of last closed checkpoints (after date and vbucket list)."""
    (count,) = struct.unpack_from(">H", connect.value, 8)
    at = 10 + 2 * count
    (entries,) = struct.unpack_from(">H", connect.value, at)
    return dict(struct.iter_unpack(">HQ", connect.value[at + 2 : at + 2 + 10 * entries]))


async def test_a_vbucket_that_cannot_resume_is_backfilled_by_2_5_1(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A reconcile cut by a gateway restart cannot resume: the ingest must have the
    vbucket backfilled whole. 2.5.1 (tapconnection.cc ``registerCursor``) starts a
    vbucket the CONNECT's checkpoint map leaves out, with no cursor left (the
    ingest deregisters first), at checkpoint 1, and backfills only when the
    checkpoint it starts at is gone (``CheckpointManager::registerTAPCursor``:
    not found). Checkpoint 1 of a young vbucket is still in memory, so the
    vbucket must be named with a checkpoint no node holds: then 2.5.1 backfills
    it, the reconcile completes, and the next reconnect resumes it as usual."""
    items = {vb: [(b"k%d" % vb, b"v")] for vb in STREAMED}
    cut, backfilled = trio.Event(), trio.Event()

    async def play(s: Session) -> None:
        n = len(node.sessions)
        if n == 1:  # everything; then a new backfill of vbucket 1 that a restart cuts
            await backfill(s, items)
            await s.send_acked(t.opaque(1, INITIAL_VBUCKET_STREAM, seqno=s.next()))
            await s.send_acked(t.mutation(1, b"k1", b"v", seqno=s.next(), cas=1, ack=True))
            cut.set()
            return
        wanted = checkpoint_map(s.connect)
        await s.send_acked(t.opaque(0, ENABLE_AUTO_NACK, seqno=s.next()))
        if 1 not in wanted:  # checkpoint 1 is still in memory: no backfill
            await s.send_acked(t.checkpoint(t.CHECKPOINT_START, 1, 1, seqno=s.next()))
            await s.send(t.mutation(1, b"k1", b"v", seqno=s.next(), cas=1, ack=True))
        else:  # the checkpoint named is gone: the whole vbucket again
            await s.send_acked(t.opaque(1, INITIAL_VBUCKET_STREAM, seqno=s.next()))
            await s.send_acked(t.mutation(1, b"k1", b"v", seqno=s.next(), cas=1, ack=True))
            await s.send(t.opaque(1, CLOSE_BACKFILL, seqno=s.next()))
        await s.wait_ack(s.seqno)
        if n == 2:
            backfilled.set()
            await s.stream.aclose()  # and once more

    node = Tap251Node(play)
    with trio.fail_after(20):
        node_port = await node.start(nursery)
        _, _, first = await start_front(nursery, tmp_path, node_port, vbuckets=STREAMED)
        await cut.wait()
        await first.stop()
        await start_front(nursery, tmp_path, node_port, vbuckets=STREAMED)
        await backfilled.wait()
        await until(lambda: len(node.sessions) == 3)
    assert node.deregistered == 1  # once, for the restart's re-fetch
    assert 1 in checkpoint_map(node.sessions[1].connect)
    assert 1 not in checkpoint_map(node.sessions[2].connect)


@pytest.mark.parametrize("events", [False, True], ids=["fast", "events"])
async def test_a_message_whose_ttl_ran_out_is_refused_with_einval(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, events: bool
) -> None:
    """memcached 2.5 daemon/memcached.c ``process_bin_tap_packet``: a TAP message
    with TTL 0 (relayed too often, a loop) is answered EINVAL (0x04), and 2.5.1's
    producer closes on any nack but BUSY/TMPFAIL (tapconnection.cc
    ``processAck``), keeping the message for the next connection. The ingest
    answers so only once all before it is logged and acked (a 2.5.1 nack
    implicitly acks what came before), logs one line and reconnects."""
    backfilled, done = trio.Event(), trio.Event()
    items = {vb: [(b"k%d" % vb, b"v")] for vb in STREAMED}

    async def play(s: Session) -> None:
        if len(node.sessions) == 1:
            await backfill(s, items)
            backfilled.set()
            good = t.mutation(1, b"good", b"g", seqno=s.next(), cas=7, ack=True)
            await s.send(good + t.mutation(1, b"looped", b"l", seqno=s.next(), cas=8, ttl=0))
            await s.closed.wait()
            return
        await s.send_acked(t.mutation(1, b"looped", b"l", seqno=s.next(), cas=8, ack=True))
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        capture = {"capture_dir": tmp_path / "capture"} if events else {}
        _, port = await upr_front_over_251(nursery, tmp_path / "state", node, **capture)
        await done.wait()
        got = items_of(await served_items(port, 1, 3))
    assert [e.key for e in got] == [b"k1", b"good", b"looped"]
    first = node.sessions[0].responses
    assert [(r.opcode, r.status) for r in first[-2:]] == [(t.MUTATION, 0), (t.MUTATION, 0x04)]
    assert [r.opaque for r in first[-2:]] == [node.sessions[0].seqno - 1, node.sessions[0].seqno]
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([m for m in lines if "opcode=0x41" in m and "field=ttl" in m]) == 1, lines
