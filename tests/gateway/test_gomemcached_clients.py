"""The Go client of go-couchbase, sync_gateway and the 3.0-era indexer, emulated.

gomemcached (``client/tap_feed.go``, ``client/upr_feed.go``, ``mc_req.go``,
``mc_res.go``, ``tap.go``; the 2014/15 copy whose UPR code still says UPR)
was run against the reference node and both fronts: these tests send, byte
for byte, what its functions send and read the answers the way its
``MCRequest.Receive`` and ``MCResponse.Receive`` split them, checking what
the client needs to go on (an opaque it can route, an extras length it does
not index out of, an ack it expects). Each test runs on the node and on the
front of that protocol, and names the client function and the released
server source it follows.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pytest
import trio

from adapters.mcbp import Frame
from gateway.node.store import Store
from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, serve_tap_side, serve_upr_side
from tests.support.raw_dcp import RawDcp, Reply
from tests.support.tap_client import TapClient

pytestmark = pytest.mark.parametrize("side", ["node", "front"])

HEADER = struct.Struct(">BBHBBHIIQ")
VBUCKETS = 4

# gomemcached tap.go TapConnectFlag, in the order TapArguments.flags() ORs them.
BACKFILL, DUMP, LIST_VBUCKETS, TAKEOVER = 0x01, 0x02, 0x04, 0x08
SUPPORT_ACK, KEYS_ONLY, CHECKPOINT, REGISTERED = 0x10, 0x20, 0x40, 0x80
TAP_CONNECT, TAP_MUTATION, TAP_DELETE, TAP_OPAQUE = 0x40, 0x41, 0x42, 0x44
TAP_CHECKPOINT_START, TAP_CHECKPOINT_END = 0x46, 0x47
OPAQUE_INITIAL_VBUCKET_STREAM, OPAQUE_CLOSE_BACKFILL = 1, 8

# client/upr_feed.go
OPAQUE_OPEN, OPAQUE_FAILOVER = 0xBEAF0001, 0xDEADBEEF
MUTATION_EXTRAS, DELETION_EXTRAS, SNAPSHOT_EXTRAS = 30, 18, 20
ROLLBACK = 0x23


def gm_request(
    opcode: int, *, key: bytes = b"", extras: bytes = b"", body: bytes = b"",
    vbucket: int = 0, opaque: int = 0,
) -> bytes:  # fmt: skip
    """mc_req.go ``MCRequest.Bytes``: magic 0x80, datatype 0, cas 0."""
    total = len(extras) + len(key) + len(body)
    return HEADER.pack(0x80, opcode, len(key), len(extras), 0, vbucket, total, opaque, 0) + (
        extras + key + body
    )


# -- TAP -------------------------------------------------------------------------


@dataclass
class TapArguments:
    """client/tap_feed.go ``TapArguments``."""

    backfill: int = 0
    dump: bool = False
    vbuckets: tuple[int, ...] = ()
    support_ack: bool = False
    keys_only: bool = False
    checkpoint: bool = False
    name: bytes = b""
    registered: bool = False

    def connect(self) -> bytes:
        """``StartTapFeed``'s request: ``flags()`` as 4 extras, ``bytes()`` as the
        body (a backfill date, then the vbucket list; never a checkpoint map nor
        the registered-client byte)."""
        flags = (
            (BACKFILL if self.backfill else 0)
            | (DUMP if self.dump else 0)
            | (LIST_VBUCKETS if self.vbuckets else 0)
            | (SUPPORT_ACK if self.support_ack else 0)
            | (KEYS_ONLY if self.keys_only else 0)
            | (CHECKPOINT if self.checkpoint else 0)
            | (REGISTERED if self.registered else 0)
        )
        body = struct.pack(">Q", self.backfill) if self.backfill else b""
        if self.vbuckets:
            body += struct.pack(">H", len(self.vbuckets))
            body += b"".join(struct.pack(">H", vb) for vb in self.vbuckets)
        return gm_request(TAP_CONNECT, key=self.name, extras=struct.pack(">I", flags), body=body)


@dataclass
class TapPacket:
    """A frame as mc_req.go ``MCRequest.Receive`` splits it: for the TAP opcodes
    0x41..0x47 the engine-specific length (the body's first 2 bytes) is added to
    the extras; extras of more than 29 bytes carry an ext-meta length at 28."""

    opcode: int
    vbucket: int
    opaque: int
    cas: int
    extras: bytes
    key: bytes
    body: bytes

    @classmethod
    def receive(cls, frame: Frame) -> TapPacket:
        buf = frame.body
        elen = frame.extras_length
        if TAP_MUTATION <= frame.opcode <= TAP_CHECKPOINT_END and len(buf) > 1:
            elen += struct.unpack_from(">H", buf)[0]
        extras = buf[:elen]
        key = buf[elen : elen + frame.key_length]
        ext_meta = struct.unpack_from(">H", extras, 28)[0] if elen > 29 else 0
        body = buf[elen + frame.key_length : len(buf) - ext_meta]
        return cls(
            frame.opcode, frame.vbucket_or_status, frame.opaque, frame.cas, extras, key, body
        )

    @property
    def asks_ack(self) -> bool:
        return len(self.extras) >= 4 and bool(struct.unpack_from(">H", self.extras, 2)[0] & 1)

    def event(self) -> tuple[str, int] | None:
        """``makeTapEvent``: what the application sees (None: nothing)."""
        if self.opcode == TAP_MUTATION:
            return ("mutation", self.vbucket)
        if self.opcode == TAP_DELETE:
            return ("deletion", self.vbucket)
        if self.opcode == TAP_CHECKPOINT_START:
            return ("checkpoint_start", self.vbucket)
        if self.opcode == TAP_CHECKPOINT_END:
            return ("checkpoint_end", self.vbucket)
        if self.opcode == TAP_OPAQUE:
            assert len(self.extras) >= 12, "makeTapEvent drops an OPAQUE without its code"
            code = struct.unpack_from(">I", self.extras, 8)[0]
            if code == OPAQUE_INITIAL_VBUCKET_STREAM:
                return ("begin_backfill", self.vbucket)
            if code == OPAQUE_CLOSE_BACKFILL:
                return ("end_backfill", self.vbucket)
        return None


def gm_tap_ack(packet: TapPacket) -> bytes:
    """tap_feed.go ``sendAck``: an MCResponse of the opcode and opaque, status 0,
    no extras, key or body."""
    return HEADER.pack(0x81, packet.opcode, 0, 0, 0, 0, 0, packet.opaque, 0)


async def run_tap_feed(port: int, args: TapArguments, *, stop: object = None) -> list[TapPacket]:
    """``runFeed``: every packet up to the close (or ``stop(packets)``), acking each
    that asks; a TAP_CONNECT response is the feed's error."""
    client = await TapClient.open(port)
    await client.send(args.connect())
    packets: list[TapPacket] = []
    try:
        while (frame := await client.next_frame()) is not None:
            assert frame.opcode != TAP_CONNECT, f"tap connection failed: {frame.body!r}"
            packet = TapPacket.receive(frame)
            packets.append(packet)
            if packet.asks_ack:
                await client.send(gm_tap_ack(packet))
            if stop is not None and stop(packets):  # type: ignore[operator]
                break
    finally:
        await client.aclose()
    return packets


def tap_store(items: int) -> Store:
    store = Store(VBUCKETS)
    for i in range(items):
        store.set(i % VBUCKETS, b"key-%06d" % i, b"v%d" % i, flags=0x01020304, now=1000.0)
    return store


def events(packets: list[TapPacket]) -> list[tuple[str, int]]:
    return [e for p in packets if (e := p.event()) is not None]


async def test_tap_dump_reads_every_item_and_ends_with_the_close(
    nursery: trio.Nursery, side: str
) -> None:
    """client/tap_feed.go ``StartTapFeed`` with ``Dump`` alone (backfill 0 sends
    no BACKFILL flag): ep-engine 2.5.1 tapconnection.cc ``TapProducer::
    setBackfillAge``/``registerCursor`` dumps every vbucket from disk, each
    wrapped in OPAQUE(initial vbucket stream) .. OPAQUE(close backfill), whose
    engine-specific code ``makeTapEvent`` reads at extras[8:12]; the feed ends
    when the server closes."""
    store = tap_store(400)
    _, port = await serve_tap_side(nursery, store, side)
    with trio.fail_after(30):
        packets = await run_tap_feed(port, TapArguments(dump=True, name=b"gm-dump"))
    seen = events(packets)
    for vb in range(VBUCKETS):
        mine = [kind for kind, v in seen if v == vb]
        assert mine[0] == "begin_backfill" and mine[-1] == "end_backfill"
        assert mine.count("mutation") == 100
    mutations = [p for p in packets if p.opcode == TAP_MUTATION]
    assert {p.key for p in mutations} == {b"key-%06d" % i for i in range(400)}
    for p in mutations:
        # Flags and expiry at extras[8:16], the value whole after the key. The
        # client never sets FIX_FLAG_BYTEORDER, so the flags come byte-swapped
        # as 2.x sent them (tapconnection.cc), and ``TapEvent.Flags`` shows that.
        assert struct.unpack_from(">II", p.extras, 8) == (0x04030201, 0)
        assert p.body == b"v%d" % int(p.key[4:])
        assert p.cas != 0


async def test_tap_backfill_of_listed_vbuckets_with_acks_then_live_items(
    nursery: trio.Nursery, side: str
) -> None:
    """``StartTapFeed`` with a past backfill date, a vbucket list, support-ack and
    a registered name (memcached 2.5 daemon/memcached.c ``process_bin_tap_connect``,
    ep-engine 2.5.1 ``TapProducer::evaluateFlags``): only the listed vbuckets come,
    backfilled; every ack-flagged message is acked by ``sendAck`` with an empty
    response and the stream goes on to live items."""
    store = tap_store(200)
    _, port = await serve_tap_side(nursery, store, side)
    args = TapArguments(
        backfill=1, vbuckets=(1, 3), support_ack=True, registered=True, name=b"gm-reg"
    )

    def live_item_came(packets: list[TapPacket]) -> bool:
        return any(p.key == b"live" for p in packets)

    with trio.fail_after(30):
        client = await TapClient.open(port)
        await client.send(args.connect())
        packets: list[TapPacket] = []
        wrote = False
        while (frame := await client.next_frame()) is not None:
            packet = TapPacket.receive(frame)
            packets.append(packet)
            if packet.asks_ack:
                await client.send(gm_tap_ack(packet))
            ends = [v for kind, v in events(packets) if kind == "end_backfill"]
            if not wrote and sorted(ends) == [1, 3]:
                store.set(3, b"live", b"now", now=1001.0)
                store.set(0, b"elsewhere", b"not listed", now=1001.0)
                wrote = True
            if live_item_came(packets):
                break
        await client.aclose()
    assert {v for _, v in events(packets)} == {1, 3}
    keys = {p.key for p in packets if p.opcode == TAP_MUTATION}
    assert keys == {b"key-%06d" % i for i in range(200) if i % VBUCKETS in (1, 3)} | {b"live"}


async def test_tap_keys_only_dump(nursery: trio.Nursery, side: str) -> None:
    """``TapArguments.KeysOnly`` (flag 0x20, ep-engine 2.5.1 tapconnection.cc
    ``TAP_CONNECT_REQUEST_KEYS_ONLY``): the mutations come without values."""
    store = tap_store(40)
    _, port = await serve_tap_side(nursery, store, side)
    with trio.fail_after(30):
        packets = await run_tap_feed(
            port, TapArguments(backfill=1, dump=True, keys_only=True, name=b"gm-keys")
        )
    mutations = [p for p in packets if p.opcode == TAP_MUTATION]
    assert len(mutations) == 40
    assert all(p.body == b"" for p in mutations)


# -- UPR -------------------------------------------------------------------------


def compose_opaque(vb: int, msb: int) -> int:
    """upr_feed.go ``composeOpaque``: the application's 16 bits over the vbucket."""
    return (msb << 16) | vb


def gm_open(name: bytes) -> bytes:
    """upr_feed.go ``doUprOpen``: sequence 0, flags 1 (producer), opaque 0xBEAF0001."""
    return gm_request(dcp.OPEN, key=name, extras=struct.pack(">II", 0, 1), opaque=OPAQUE_OPEN)


def gm_stream_req(
    vb: int, msb: int, uuid: int, start: int, end: int, snap: tuple[int, int]
) -> bytes:
    """upr_feed.go ``UprRequestStream``: 48 extras, flags 0."""
    extras = struct.pack(">IIQQQQQ", 0, 0, start, end, uuid, *snap)
    return gm_request(dcp.STREAM_REQ, extras=extras, vbucket=vb, opaque=compose_opaque(vb, msb))


async def gm_feed(port: int, name: bytes, buffer_size: int = 0) -> RawDcp:
    """``NewUprFeed`` + ``UprOpen``: the OPEN's response must be opcode 0x50 with
    the OPEN's opaque and status 0, then CONTROL connection_buffer_size (decimal,
    opaque 0) when a buffer size is given."""
    client = await RawDcp.connect(port)
    await client.send(gm_open(name))
    got = await client.next()
    assert got is not None
    assert (got.magic, got.opcode, got.opaque, got.status) == (0x81, dcp.OPEN, OPAQUE_OPEN, 0)
    if buffer_size:
        await client.send(
            gm_request(dcp.CONTROL, key=b"connection_buffer_size", body=b"%d" % buffer_size)
        )
    return client


def failover_log(value: bytes) -> list[tuple[int, int]]:
    """upr_feed.go ``parseFailoverLog``: a body not a multiple of 16 is an error."""
    assert len(value) % 16 == 0
    return [struct.unpack_from(">QQ", value, i) for i in range(0, len(value), 16)]


@dataclass
class FeedState:
    """What ``runFeed`` keeps: the streams by vbucket, the bytes to ack."""

    max_ack: int
    to_ack: int = 0
    acks: int = 0


async def gm_run_feed(
    client: RawDcp, state: FeedState, streams: dict[int, list[Reply]], *, stop: object = None
) -> None:
    """``runFeed`` until every stream ended: each message routed by the low 16
    bits of its opaque to a stream that must exist (else the feed breaks); the
    bytes of items, markers, STREAM_ENDs and CLOSE_STREAM responses acked once
    they pass 20% of the buffer (every one with no buffer size), by a BUFFER_ACK
    of opaque 0."""
    open_vbs = set(streams)
    while open_vbs:
        got = await client.next()
        assert got is not None, "the server closed the feed"
        vb = got.opaque & 0xFFFF
        assert vb in streams, f"Stream not found for vb {vb}: opcode {got.opcode:#x}"
        streams[vb].append(got)
        send_ack = False
        if got.opcode == dcp.STREAM_REQ:
            assert got.magic == 0x81
            if got.status == ROLLBACK:
                # handleStreamRequest: ``binary.BigEndian.Uint64(res.Body)``.
                assert len(got.value) >= 8 and got.extras == b""
                open_vbs.discard(vb)
            elif got.status == 0:
                failover_log(got.value)
            else:
                open_vbs.discard(vb)
        elif got.opcode in (dcp.MUTATION, dcp.DELETION, dcp.EXPIRATION):
            need = MUTATION_EXTRAS if got.opcode == dcp.MUTATION else DELETION_EXTRAS
            assert len(got.extras) >= need
            send_ack = True
        elif got.opcode == dcp.MARKER:
            assert len(got.extras) >= SNAPSHOT_EXTRAS
            send_ack = True
        elif got.opcode == dcp.STREAM_END:
            send_ack = True
            open_vbs.discard(vb)
        elif got.opcode == dcp.CLOSE_STREAM:
            # Its response becomes a simulated STREAM_END whose bytes count too.
            send_ack = True
            open_vbs.discard(vb)
        else:
            assert got.opcode == dcp.CONTROL and got.status == 0, got
        if send_ack:
            total = state.to_ack + got.size
            if total > state.max_ack:
                state.to_ack = 0
                state.acks += 1
                await client.send(gm_request(dcp.BUFFER_ACK, extras=struct.pack(">I", total)))
            else:
                state.to_ack = total
        if stop is not None and stop(streams):  # type: ignore[operator]
            return


def items(replies: list[Reply]) -> list[Reply]:
    return [r for r in replies if r.opcode in (dcp.MUTATION, dcp.DELETION, dcp.EXPIRATION)]


async def gm_failover_logs(port: int, vbs: list[int]) -> dict[int, list[tuple[int, int]]]:
    """client ``UprGetFailoverLog``: OPEN "FailoverLog", then GET_FAILOVER_LOG per
    vbucket with opaque 0xDEADBEEF, each answered opcode 0x54, status 0."""
    client = await RawDcp.connect(port)
    await client.send(gm_open(b"FailoverLog"))
    got = await client.next()
    assert got is not None and got.status == 0 and got.opaque == OPAQUE_OPEN
    logs = {}
    for vb in vbs:
        await client.send(gm_request(dcp.FAILOVER_LOG, vbucket=vb, opaque=OPAQUE_FAILOVER))
        got = await client.next()
        assert got is not None
        assert (got.opcode, got.status, got.opaque) == (dcp.FAILOVER_LOG, 0, OPAQUE_FAILOVER)
        logs[vb] = failover_log(got.value)
    await client.aclose()
    return logs


@pytest.mark.parametrize("buffer_size", [0, 4000])
async def test_upr_streams_read_to_the_end_then_resume_from_a_seqno(
    nursery: trio.Nursery, side: str, tmp_path: object, buffer_size: int
) -> None:
    """upr_feed.go ``UprOpen`` (with and without ``connection_buffer_size``),
    ``UprRequestStream`` for several vbuckets on one connection, ``runFeed``'s
    routing and buffer acks (ep-engine 3.0.0 src/upr-producer.cc ``streamRequest``,
    ``bufferAcknowledgement``; src/upr-stream.cc ``ActiveStream``): every item to
    the end seqno, then STREAM_END; a second feed resumes from the middle with
    the uuid of the newest failover entry and gets exactly the rest."""
    store = filled(400, removals=True)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)  # type: ignore[arg-type]
    vbs = [0, 1, 2, 3]
    with trio.fail_after(60):
        logs = await gm_failover_logs(port, vbs)
        admin = await RawDcp.connect(port)
        _, seqnos = await admin.stats(b"vbucket-seqno")
        await admin.aclose()
        high = {vb: int(seqnos[f"vb_{vb}:high_seqno"]) for vb in vbs}

        client = await gm_feed(port, b"gm-full", buffer_size)
        streams: dict[int, list[Reply]] = {vb: [] for vb in vbs}
        for vb in vbs:
            await client.send(gm_stream_req(vb, 7, 0, 0, high[vb], (0, 0)))
        state = FeedState(max_ack=buffer_size // 5)
        await gm_run_feed(client, state, streams)
        await client.aclose()
        for vb in vbs:
            got = items(streams[vb])
            seqnos_seen = [r.by_seqno for r in got]
            assert seqnos_seen == sorted(set(seqnos_seen)) and seqnos_seen[-1] == high[vb]
            assert streams[vb][-1].opcode == dcp.STREAM_END
            mine = [r for r in streams[vb] if r.opcode != dcp.CONTROL]  # opaque 0: "vb 0"
            assert all(r.opaque == compose_opaque(vb, 7) for r in mine)
        assert state.acks > 0

        resumed: dict[int, list[Reply]] = {vb: [] for vb in vbs}
        client = await gm_feed(port, b"gm-resume", buffer_size)
        for vb in vbs:
            mid = high[vb] // 2
            uuid = logs[vb][0][0]
            await client.send(gm_stream_req(vb, 9, uuid, mid, high[vb], (mid, mid)))
        await gm_run_feed(client, FeedState(max_ack=buffer_size // 5), resumed)
        await client.aclose()
    for vb in vbs:
        full = {r.by_seqno: r.key for r in items(streams[vb])}
        rest = {r.by_seqno: r.key for r in items(resumed[vb])}
        assert rest == {s: k for s, k in full.items() if s > high[vb] // 2}
    del server


async def test_upr_unknown_uuid_rolls_back_with_the_seqno_in_the_body(
    nursery: trio.Nursery, side: str, tmp_path: object
) -> None:
    """upr_feed.go ``handleStreamRequest`` reads a ROLLBACK's seqno as
    ``binary.BigEndian.Uint64(res.Body)``: the 8 bytes must be the value, with no
    extras (ep-engine 3.0.0 src/upr-producer.cc ``streamRequest`` puts
    ``rollbackSeqno`` in the response body), or the client panics."""
    store = filled(40)
    _, port = await serve_upr_side(nursery, store, side, tmp_path)  # type: ignore[arg-type]
    with trio.fail_after(30):
        client = await gm_feed(port, b"gm-rollback")
        streams: dict[int, list[Reply]] = {0: [], 1: []}
        for vb in streams:
            await client.send(gm_stream_req(vb, 3, 0xDEADBEEF, 5, 10, (5, 5)))
        await gm_run_feed(client, FeedState(max_ack=0), streams)
        await client.aclose()
    for vb, replies in streams.items():
        (answer,) = replies
        assert answer.status == ROLLBACK and answer.opaque == compose_opaque(vb, 3)
        # Exactly 8 bytes: couchbase-cli 3.0 pump_upr.py unpacks the whole body as ">Q".
        assert answer.value == struct.pack(">Q", 0)


async def test_upr_close_stream_leaves_nothing_of_that_vbucket_behind(
    nursery: trio.Nursery, side: str, tmp_path: object
) -> None:
    """upr_feed.go ``CloseStream`` sends CLOSE_STREAM with the stream's opaque;
    ``runFeed`` turns its response into a STREAM_END and forgets the stream, so
    any later message of that vbucket would find no stream and break the whole
    feed. ep-engine 3.0.0 src/upr-producer.cc ``closeStream`` drops the stream
    before answering and sends no STREAM_END of it; the other streams go on."""
    store = filled(2000)
    _, port = await serve_upr_side(nursery, store, side, tmp_path)  # type: ignore[arg-type]
    with trio.fail_after(30):
        client = await gm_feed(port, b"gm-close", 2000)
        streams: dict[int, list[Reply]] = {0: [], 1: []}
        for vb in streams:
            await client.send(gm_stream_req(vb, 5, 0, 0, dcp.MAX_SEQNO, (0, 0)))
        state = FeedState(max_ack=400)

        def some_items(s: dict[int, list[Reply]]) -> bool:
            return len(items(s[0])) >= 3

        await gm_run_feed(client, state, streams, stop=some_items)
        await client.send(gm_request(dcp.CLOSE_STREAM, vbucket=0, opaque=compose_opaque(0, 5)))

        def vb1_done(s: dict[int, list[Reply]]) -> bool:
            return len(items(s[1])) == 500

        await gm_run_feed(client, state, streams, stop=vb1_done)
        await client.aclose()
    closing = [r for r in streams[0] if r.opcode == dcp.CLOSE_STREAM]
    assert len(closing) == 1 and closing[0].status == 0
    assert streams[0][-1] is closing[0]


async def test_upr_noop_controls_of_the_later_copy_are_granted(
    nursery: trio.Nursery, side: str, tmp_path: object
) -> None:
    """The later copy of ``uprOpen`` also sends CONTROL enable_noop "true" and
    set_noop_interval "120" (opaque 0; ``runFeed`` only logs a failure) and
    answers a NOOP with an MCResponse of the NOOP's opaque; the older copy sent
    connection_buffer_size alone. ep-engine 3.0.0 src/upr-producer.cc
    ``control`` grants enable_noop but knows no set_noop_interval (EINVAL,
    which the client logs); we grant it as later ``DcpProducer::control`` does."""
    _, port = await serve_upr_side(nursery, filled(8), side, tmp_path)  # type: ignore[arg-type]
    with trio.fail_after(30):
        client = await gm_feed(port, b"gm-noop", 10_000)
        await client.send(
            gm_request(dcp.CONTROL, key=b"enable_noop", body=b"true"),
            gm_request(dcp.CONTROL, key=b"set_noop_interval", body=b"120"),
        )
        answers = [await client.next() for _ in range(3)]
        await client.aclose()
    assert [(a.opcode, a.status) for a in answers if a is not None] == [(dcp.CONTROL, 0)] * 3


@pytest.mark.parametrize("checkpoint", [False, True])
async def test_tap_checkpoint_messages_only_for_a_client_that_asks(
    nursery: trio.Nursery, side: str, checkpoint: bool
) -> None:
    """ep-engine 2.5.1 src/tapconnection.cc: ``nextFgFetched_UNLOCKED`` queues
    CHECKPOINT_START/END (``addCheckpointMessage_UNLOCKED``) only when
    ``supportCheckpointSync_``, which ``TapProducer::evaluateFlags`` sets for the
    CHECKPOINT flag alone; otherwise the cursor passes the boundaries silently.
    gomemcached's ``TapArguments`` sets it only with ``Checkpoint``; without it
    the live items come alone (they came each wrapped in its own checkpoint pair)."""
    store = tap_store(8)
    _, port = await serve_tap_side(nursery, store, side)
    args = TapArguments(backfill=1, vbuckets=(2,), checkpoint=checkpoint, name=b"gm-live")
    with trio.fail_after(30):
        client = await TapClient.open(port)
        await client.send(args.connect())
        packets: list[TapPacket] = []
        live = 0
        while live < 5 and (frame := await client.next_frame()) is not None:
            packet = TapPacket.receive(frame)
            packets.append(packet)
            if packet.asks_ack:
                await client.send(gm_tap_ack(packet))
            live += packet.key.startswith(b"live-")
            if packet.event() == ("end_backfill", 2):
                for i in range(5):  # each in a checkpoint of its own
                    store.set(2, b"live-%d" % i, b"v", now=1001.0 + i)
                    store.close_checkpoint(2)
        await client.aclose()
    start = [k for k, _ in events(packets)].index("end_backfill")
    kinds = [kind for kind, _ in events(packets)][start:]
    assert kinds.count("mutation") == 5
    assert ("checkpoint_start" in kinds) is checkpoint
    assert ("checkpoint_end" in kinds) is checkpoint
