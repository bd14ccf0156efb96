"""Real 2.x TAP clients against the reference node and the TAP front alike.

Every CONNECT and ack here is built byte by byte as the classic 2.x Python
client sends it (``tests.support.classic_tap``: ep-engine management/tap.py
``TapConnection._createTapCall`` and ``_encodeOpts``; mc_bin_server.py
``MemcachedBinaryChannel.handle_read`` for the replies), not through the
project's encoder, and each test runs on
both sides: the node is the test peer of the front, so a misreading shared
by both would otherwise pass.
"""

from __future__ import annotations

import time

import pytest
import trio

from adapters.mcbp import Frame, Magic, Status
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapEvent,
    TapMutation,
    TapOpaque,
    TapOpcode,
    TapResponse,
    decode_frame,
)
from tests.support.classic_tap import (
    HEADER,
    TAP_OPCODES,
    asks_for_ack,
    classic_connect,
    classic_reply,
)
from tests.support.fronts import filled, serve_tap_side
from tests.support.raw_dcp import RawDcp
from tests.support.tap_client import TapClient, until
from tests.support.tapfront import Replica, check_brackets, closes, node_state

F = ConnectFlags
VBUCKETS = 4
pytestmark = pytest.mark.parametrize("side", ["node", "front"])


async def read_events(client: TapClient, until: object = None) -> list[TapEvent]:
    """Events up to ``until(events so far)`` or the close, acking as the classic client."""
    events: list[TapEvent] = []
    while (frame := await client.next_frame()) is not None:
        events.append(decode_frame(frame))
        if asks_for_ack(frame):
            await client.send(classic_reply(frame))
        if until is not None and until(events):  # type: ignore[operator]
            break
    return events


async def test_classic_acks_and_nacks_carry_a_support_ack_dump_to_its_end(
    nursery: trio.Nursery, side: str
) -> None:
    """memcached 2.x daemon/memcached.c: ``dispatch_bin_command`` reads
    ``bodylen`` bytes of a TAP response and ``process_bin_tap_ack`` passes on
    its opaque and status, whatever key and extras lengths the header claims.
    The classic client's replies claim the request's key and the opcode's
    extras over an empty body (or a nack's text). A busy nack makes the server
    resend from the first unacked message (tapconnection.cc, ``processAck``)."""
    items = 5750
    store = filled(items)
    _, port = await serve_tap_side(nursery, store, side)
    with trio.fail_after(60):
        client = await TapClient.open(port)
        await client.send(classic_connect(b"backup", {F.DUMP: b"", F.SUPPORT_ACK: b""}))
        frames: list[Frame] = []
        nacked: int | None = None
        resent_from = None
        while (frame := await client.next_frame()) is not None:
            frames.append(frame)
            if frame.opaque == nacked:
                resent_from = len(frames) - 1
            if not asks_for_ack(frame) or (nacked is not None and resent_from is None):
                continue  # a busy replica acks nothing until the resend comes
            if nacked is None and frame.opcode == TapOpcode.MUTATION:
                nacked = frame.opaque  # once: "try again later", sloppy header and a text
                await client.send(classic_reply(frame, Status.BUSY, b"replica queue full"))
            else:
                await client.send(classic_reply(frame))
        await client.aclose()
    assert resent_from is not None
    assert not [f for f in frames if f.magic == Magic.RESPONSE]  # never an error reply
    # The resend repeats the unacked messages under their sequence numbers; by
    # sequence number the stream is each key once, each vbucket bracketed once
    # (tapconnection.cc, registerCursor: a dump is a backfill of each vbucket).
    by_seqno = {f.opaque: decode_frame(f) for f in frames if f.opcode in TAP_OPCODES}
    assert len(by_seqno) < sum(f.opcode in TAP_OPCODES for f in frames)
    stream = [by_seqno[n] for n in sorted(by_seqno)]
    keys = [e.key for e in stream if isinstance(e, TapMutation)]
    assert sorted(keys) == [b"key-%06d" % i for i in range(items)]
    check_brackets(stream)
    wraps = (OpaqueCode.INITIAL_VBUCKET_STREAM, OpaqueCode.CLOSE_BACKFILL)
    opaques = [e for e in stream if isinstance(e, TapOpaque) and e.opaque_code in wraps]
    assert sorted((e.vbucket, e.opaque_code) for e in opaques) == [
        (vb, code) for vb in range(VBUCKETS) for code in wraps
    ]


async def test_checkpoint_flag_without_a_map_is_served(nursery: trio.Nursery, side: str) -> None:
    """ep-engine 2.x ep_engine.cc ``createTapQueue`` reads the checkpoint count
    only if two bytes are left: tap.py sends CHECKPOINT as '' (no map at all)."""
    store = filled(400)
    _, port = await serve_tap_side(nursery, store, side)
    replica = Replica()
    with trio.fail_after(20):
        client = await TapClient.open(port)
        opts: dict[int, object] = {F.BACKFILL: 0, F.CHECKPOINT: b"", F.SUPPORT_ACK: b""}
        await client.send(classic_connect(b"cp-nomap", opts))
        events = await read_events(client, lambda ev: closes(ev) == VBUCKETS)
        await client.aclose()
    assert not [e for e in events if isinstance(e, TapResponse)]
    assert [e.opaque_code for e in events[:2]] == [  # type: ignore[union-attr]
        OpaqueCode.ENABLE_AUTO_NACK,
        OpaqueCode.ENABLE_CHECKPOINT_SYNC,
    ]
    replica.apply(events)
    assert replica.items == node_state(store, range(VBUCKETS))


async def test_a_registered_name_in_use_is_refused_and_the_first_keeps_streaming(
    nursery: trio.Nursery, side: str
) -> None:
    """ep-engine 2.x ep_engine.cc ``createTapQueue``: a REGISTERED_CLIENT CONNECT
    under the name of a producer that is connected (and not disconnecting)
    fails, and memcached answers NOT_SUPPORTED and closes (daemon/memcached.c,
    ``process_bin_tap_connect``). Without the flag the newcomer takes the name
    over (tapconnmap.cc ``TapConnMap::newProducer``, "grabbing the channel")."""
    store = filled(40)
    _, port = await serve_tap_side(nursery, store, side)
    registered = {F.BACKFILL: 0, F.SUPPORT_ACK: b"", F.REGISTERED_CLIENT: b""}
    with trio.fail_after(20):
        first = await TapClient.open(port)
        await first.send(classic_connect(b"replica", registered))
        await read_events(first, lambda ev: closes(ev) == VBUCKETS)
        second = await TapClient.open(port)
        await second.send(classic_connect(b"replica", registered))
        refusal = await second.next_frame()
        assert refusal is not None
        assert (refusal.magic, refusal.opcode, refusal.vbucket_or_status) == (
            Magic.RESPONSE,
            TapOpcode.CONNECT,
            Status.NOT_SUPPORTED,
        )
        assert b"replica" in refusal.value and b"already connected" in refusal.value
        assert await second.next_frame() is None
        store.set(1, b"after-refusal", b"x", now=time.time())
        events = await read_events(
            first, lambda ev: isinstance(ev[-1], TapMutation) and ev[-1].key == b"after-refusal"
        )
        assert events[-1].key == b"after-refusal"  # type: ignore[union-attr]
        # A namesake that is not registered replaces it, as 2.x did.
        third = await TapClient.open(port)
        await third.send(classic_connect(b"replica", {F.BACKFILL: 0}))
        await read_events(third, lambda ev: closes(ev) == VBUCKETS)
        await read_events(first)  # on to the close
        assert first.closed
        for client in (first, second, third):
            await client.aclose()


async def test_a_vbucket_list_of_none_streams_every_vbucket(
    nursery: trio.Nursery, side: str
) -> None:
    """ep-engine 2.x: ``createTapQueue`` takes a LIST_VBUCKETS count of 0 as an
    empty list and ``VBucketFilter`` (vbucket.hh) accepts every vbucket when its
    list is empty."""
    store = filled(200)
    _, port = await serve_tap_side(nursery, store, side)
    replica = Replica()
    with trio.fail_after(20):
        client = await TapClient.open(port)
        await client.send(classic_connect(b"all", {F.BACKFILL: 0, F.LIST_VBUCKETS: []}))
        events = await read_events(client, lambda ev: closes(ev) == VBUCKETS)
        await client.aclose()
    replica.apply(events)
    assert sorted(replica.resets) == list(range(VBUCKETS))
    assert replica.items == node_state(store, range(VBUCKETS))
    check_brackets(events)


async def test_unknown_connect_flags_and_their_data_are_ignored(
    nursery: trio.Nursery, side: str
) -> None:
    """ep-engine 2.x ep_engine.cc ``createTapQueue`` never rejects a flag bit it
    does not know, nor bytes left after the options it reads."""
    store = filled(120)
    _, port = await serve_tap_side(nursery, store, side)
    replica = Replica()
    with trio.fail_after(20):
        client = await TapClient.open(port)
        opts: dict[int, object] = {F.BACKFILL: 0, 0x200: b"\x00\x07", 0x10000: b"later"}
        await client.send(classic_connect(b"newer-client", opts))
        events = await read_events(client, lambda ev: closes(ev) == VBUCKETS)
        await client.aclose()
    replica.apply(events)
    assert replica.items == node_state(store, range(VBUCKETS))


async def test_a_busy_nack_without_support_ack_pauses_the_stream_only(
    nursery: trio.Nursery, side: str
) -> None:
    """ep-engine 2.x tapconnection.cc ``TapProducer::processAck`` runs for any
    response, support-ack or not: a busy nack (a replica that could not apply a
    message answers unasked) suspends the stream for the backoff, with nothing
    to resend; then it goes on."""
    store = filled(800)
    server, port = await serve_tap_side(nursery, store, side)
    replica = Replica()
    with trio.fail_after(20):
        client = await TapClient.open(port)
        await client.send(classic_connect(b"no-acks", {F.BACKFILL: 0}))
        events: list[TapEvent] = []
        mutation = None
        while closes(events) < VBUCKETS:
            frame = await client.next_frame()
            assert frame is not None, "the server closed the stream"
            events.append(decode_frame(frame))
            mutation = frame if frame.opcode == TapOpcode.MUTATION else mutation
        assert mutation is not None
        await client.send(classic_reply(mutation, Status.BUSY, b"cannot apply now"))
        streams = server.tap if side == "node" else server.sessions  # type: ignore[attr-defined]
        await until(lambda: streams.get("no-acks").producer.nacks_total == 1)
        store.set(2, b"after-the-nack", b"x", now=time.time())
        events += await read_events(
            client, lambda ev: isinstance(ev[-1], TapMutation) and ev[-1].key == b"after-the-nack"
        )
        await client.aclose()
    replica.apply(events)
    assert replica.items == node_state(store, range(VBUCKETS))
    assert replica.mutations == 801  # nothing was sent twice


async def test_tap_vbtakeover_and_stat_upr_on_the_tap_side(
    nursery: trio.Nursery, side: str
) -> None:
    """ep-engine v2.5.1 src/ep_engine.cc ``getStats``: ``tap-vbtakeover <vb>
    <name>`` (``doTapVbTakeoverStats``) tells how much that TAP connection has
    still to send (our ``vbucket-takeover`` stays an alias). ``STAT upr`` on
    the TAP front answers about its upstream UPR connections, the ``ep_dcp_*``
    totals as v3.0.0 ``doDcpStats`` names them."""
    store = filled(80)
    _, port = await serve_tap_side(nursery, store, side)
    with trio.fail_after(20):
        client = await TapClient.open(port)
        await client.send(classic_connect(b"mover", {F.BACKFILL: 0}))
        await read_events(client, lambda ev: closes(ev) == VBUCKETS)
        admin = await RawDcp.connect(port)
        for group in (b"tap-vbtakeover", b"vbucket-takeover"):
            status, pairs = await admin.stats(group + b" 1 mover")
            assert status == 0, group
            assert pairs["estimate"] == "0" and pairs["name"] == "eq_tapq:mover", group
        assert (await admin.stats(b"tap-vbtakeover 1 nobody"))[0] == Status.KEY_NOT_FOUND
        assert (await admin.stats(b"tap-vbtakeover x mover"))[0] == Status.INVALID_ARGUMENTS
        status, pairs = await admin.stats(b"upr")
        assert status == 0
        consumers = "1" if side == "front" else "0"  # the front's upstream connection
        assert pairs["ep_dcp_count"] == pairs["ep_dcp_consumer_count"] == consumers
        if side == "front":
            assert pairs["eq_dcpq:mover:type"] == "consumer"
        await admin.aclose()
        await client.aclose()


def command(opcode: int, opaque: int, key: bytes = b"", vbucket: int = 0) -> bytes:
    """A plain memcached request as mc_bin_client.py packs it (no extras)."""
    return HEADER.pack(0x80, opcode, len(key), 0, 0, vbucket, len(key), opaque, 0) + key


async def test_commands_on_a_tap_stream_are_answered_between_its_messages(
    nursery: trio.Nursery, side: str
) -> None:
    """memcached 2.x daemon/memcached.c: ``conn_ship_log`` runs every packet a
    TAP connection receives through ``try_read_command``, the ordinary command
    dispatcher (``dispatch_bin_command``: VERSION, NOOP, STAT; anything else to
    the engine, whose ``processUnknownCommand`` answers UNKNOWN_COMMAND), and
    ``conn_set_state`` sends the connection back to ``conn_ship_log`` after the
    reply. So a command is answered in one piece between two stream messages
    and the stream goes on; an unknown opcode does not close it."""
    items = 2000
    store = filled(items)
    _, port = await serve_tap_side(nursery, store, side)
    get_status = 0 if side == "node" else Status.UNKNOWN_COMMAND  # the front serves no GET
    expected = {0xA1: 0, 0xA2: 0, 0xA3: 0, 0xA4: Status.UNKNOWN_COMMAND, 0xA5: get_status}
    with trio.fail_after(30):
        client = await TapClient.open(port)
        await client.send(classic_connect(b"asks", {F.BACKFILL: 0}))
        first = await client.next_frame()
        assert first is not None and first.is_request
        await client.send(
            command(0x0B, 0xA1)  # VERSION
            + command(0x10, 0xA2)  # STAT (the general group)
            + command(0x0A, 0xA3)  # NOOP
            + command(0xEE, 0xA4)  # nobody's opcode
            + command(0x00, 0xA5, b"key-000000")  # GET
        )
        replies: dict[int, list[Frame]] = {}
        keys: set[bytes] = set()
        later = False  # a stream message after the last reply

        def done() -> bool:
            return keys == {b"key-%06d" % i for i in range(items)} | {b"later"}

        while not done():
            frame = await client.next_frame()
            assert frame is not None, "the stream closed"
            if frame.magic == Magic.RESPONSE:
                replies.setdefault(frame.opaque, []).append(frame)
                continue
            event = decode_frame(frame)  # every stream message whole
            if isinstance(event, TapMutation):
                keys.add(event.key)
            if not later and set(replies) == set(expected) and replies[0xA2][-1].key == b"":
                later = True
                store.set(1, b"later", b"x", now=time.time())
    assert {opaque: got[-1].vbucket_or_status for opaque, got in replies.items()} == expected
    assert replies[0xA1][0].value  # the version text
    assert len(replies[0xA2]) > 1 and all(f.key for f in replies[0xA2][:-1])
    if side == "node":
        assert replies[0xA5][0].value == b"v0"
    await client.aclose()
