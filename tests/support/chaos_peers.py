"""The peers of a chaos run: a writer on the node, UPR consumers and TAP clients of ``serve``.

Each one reconnects whenever its connection breaks and keeps what it holds,
as a real peer does: the UPR consumers resume with their last seqno, snapshot
and vbucket uuid (ep-engine v3.0.0 src/upr-consumer.cc ``doRollback``), the
registered TAP client under its name (2.5.1 src/tapconnmap.cc
``TapConnMap::newProducer``).
"""

from __future__ import annotations

import random
import struct

import trio

from adapters import upr
from adapters.mcbp import Status
from adapters.mcbp.constants import Opcode
from adapters.tap import ConnectFlags, TapConnect, decode_frame, encode
from gateway.io.connection import ConnectionClosed, ConnectionLost, PacketConnection
from tests.gateway.test_tap_2x_clients import asks_for_ack, classic_reply
from tests.support import raw_dcp
from tests.support.crash_harness import Consumer, VbView
from tests.support.tap_client import TapClient
from tests.support.tapfront import Replica

LINK_ERRORS = (
    EOFError,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    ConnectionLost,
    ConnectionClosed,
)

State = dict[tuple[int, bytes], tuple[int, bytes]]
"""(vbucket, key) -> (cas, value) of every live key."""


class Port:
    """Where a peer connects now (a relay's port is fixed; a process's changes)."""

    def __init__(self, port: int = 0) -> None:
        self.port = port


class NodeWriter:
    """Sets (some with a TTL of a few seconds) and deletes on the node, over memcached."""

    def __init__(self, port: Port, vbuckets: int, rng: random.Random, keys: int = 200) -> None:
        self.port = port
        self.vbuckets = vbuckets
        self.rng = rng
        self.keys = keys
        self.written = 0
        self.max_ttl = 3
        self.scope = trio.CancelScope()

    async def run(self) -> None:
        with self.scope:
            await self._run()

    async def _run(self) -> None:
        while True:
            try:
                conn = await PacketConnection.connect("127.0.0.1", self.port.port)
            except OSError:
                await trio.sleep(0.05)
                continue
            try:
                await self._write(conn)
            except LINK_ERRORS:
                await trio.sleep(0.05)  # the node went away
            finally:
                with trio.CancelScope(shield=True):
                    await conn.aclose()

    async def _write(self, conn: PacketConnection) -> None:
        rng = self.rng
        while True:
            for _ in range(rng.randrange(1, 20)):
                vb = rng.randrange(self.vbuckets)
                key = b"key-%d" % rng.randrange(self.keys)
                if rng.random() < 0.15:
                    await conn.request(Opcode.DELETE, key=key, vbucket=vb, check=False)
                else:
                    ttl = rng.randint(1, self.max_ttl) if rng.random() < 0.1 else 0
                    value = bytes([97 + self.written % 26]) * rng.choice((8, 100, 1500))
                    extras = struct.pack(">II", self.written & 0xFFFF, ttl)
                    await conn.request(
                        Opcode.SET, key=key, value=value, extras=extras, vbucket=vb, check=False
                    )
                self.written += 1
            await trio.sleep(0.01)


async def node_state(port: int, vbuckets: int, name: bytes) -> State:
    """Every live key of the node, read whole over UPR."""
    async with await PacketConnection.connect("127.0.0.1", port) as admin:
        seqnos = await admin.stats("vbucket-seqno")
    client = raw_dcp.RawDcp(await trio.open_tcp_stream("127.0.0.1", port))
    out: State = {}
    try:
        await client.send(raw_dcp.open_producer(name))
        assert (await client.response(1)).status == 0
        for vb in range(vbuckets):
            high = int(seqnos[f"vb_{vb}:high_seqno"])
            if high == 0:
                continue
            await client.send(raw_dcp.stream_req(vb, vb + 100, 0, high))
            assert (await client.response(vb + 100)).status == 0
            while True:
                got = await client.next()
                assert got is not None, "the node closed the audit"
                if got.magic == raw_dcp.REQ and got.opcode == raw_dcp.NOOP:
                    await client.send(raw_dcp.reply(got))
                    continue
                if got.opaque != vb + 100:
                    continue
                if got.opcode == raw_dcp.STREAM_END:
                    break
                if got.opcode == raw_dcp.MUTATION:
                    out[vb, got.key] = (_cas(got), got.value)
                elif got.opcode in (raw_dcp.DELETION, raw_dcp.EXPIRATION):
                    out.pop((vb, got.key), None)
    finally:
        await client.aclose()
    return out


def _cas(reply: raw_dcp.Reply) -> int:
    return reply.cas


# -- UPR consumers --------------------------------------------------------------


class ChaosConsumer(Consumer):
    """The crash harness's 3.0 consumer (the project's client), reconnecting for ever and
    patient with vbuckets not yet open (the upstream may be down a long while)."""

    async def _request(self, client, vb, view):  # type: ignore[no-untyped-def]
        for _ in range(2000):
            v = self.views[vb]
            reply = await client.stream_request(
                vb, v.seqno, raw_dcp.MAX_SEQNO, uuid=v.uuid, snap=v.request_snap(), opaque=vb + 1
            )
            if isinstance(reply, upr.StreamRequestRollback):
                to = reply.rollback_seqno
                assert to < v.seqno, f"vb {vb}: ROLLBACK to {to} from {v.seqno}"
                self.rollbacks.append((vb, v.seqno, to))
                v.rollback(to)
                continue
            if reply.status in (Status.NOT_MY_VBUCKET, Status.TEMPORARY_FAILURE):
                await trio.sleep(0.05)
                continue
            assert isinstance(reply, upr.StreamRequestOk), (vb, reply)
            known = {uuid for uuid, _ in reply.failover_log}
            assert v.seqno == 0 or v.uuid in known, (
                f"vb {vb}: streams from {v.seqno} of history {v.uuid}, not in {reply.failover_log}"
            )
            v.failover = reply.failover_log
            if reply.failover_log:
                v.uuid = reply.failover_log[0][0]
            return
        raise AssertionError(f"vb {vb}: no stream after 2000 requests")

    async def run(self, port: Port) -> None:
        while True:
            await self.session(port.port, None)
            await trio.sleep(0.05)

    def live(self) -> State:
        return _live(self.views)


def _live(views: dict[int, VbView]) -> State:
    return {
        (vb, key): (cas, value)
        for vb, v in views.items()
        for key, (cas, value) in v.state().items()
        if value is not None
    }


BUFFER = 64 * 1024
"""The raw consumer's flow-control buffer."""
COUNTED = frozenset(
    {raw_dcp.MARKER, raw_dcp.MUTATION, raw_dcp.DELETION, raw_dcp.EXPIRATION, raw_dcp.STREAM_END,
     raw_dcp.SET_VBUCKET_STATE}
)  # fmt: skip
"""What flow control counts (as ``adapters.upr.flow_control``)."""


class RawConsumer:
    """A 3.0 consumer on raw frames (``raw_dcp``): its own parser, its own rollback
    bookkeeping; ``pause`` stops it reading (the gateway must hold it back, not grow)."""

    def __init__(self, port: Port, vbuckets: int, name: bytes = b"raw-chaos") -> None:
        self.port = port
        self.name = name
        self.views = {vb: VbView() for vb in range(vbuckets)}
        self.served: dict[tuple[int, int], tuple[bytes, bytes | None, int, int]] = {}
        self.rollbacks = 0
        self.items = 0
        self.sessions = 0
        self.where: dict[tuple[int, int], str] = {}
        self.reading = trio.Event()
        self.reading.set()

    async def pause(self, seconds: float) -> None:
        if self.reading.is_set():  # else an overlapping pause holds it already
            self.reading = trio.Event()
        held = self.reading
        try:
            await trio.sleep(seconds)
        finally:
            held.set()

    async def run(self) -> None:
        while True:
            try:
                client = await raw_dcp.RawDcp.connect(self.port.port)
            except OSError:
                await trio.sleep(0.05)
                continue
            self.sessions += 1
            try:
                await self._session(client)
            except LINK_ERRORS:
                pass
            finally:
                await client.aclose()
            await trio.sleep(0.05)

    def _request(self, vb: int) -> bytes:
        v = self.views[vb]
        return raw_dcp.stream_req(vb, vb + 1, v.seqno, uuid=v.uuid, snap=v.request_snap())

    async def _session(self, client: raw_dcp.RawDcp) -> None:
        await client.send(raw_dcp.open_producer(self.name, opaque=0xFFFF))
        opened = await client.next()
        if opened is None:  # the relay had no gateway to reach
            return
        assert (opened.magic, opened.opaque, opened.status) == (raw_dcp.RES, 0xFFFF, 0), opened
        # Flow control and NOOPs: a pause stops the acks too, and a long one the NOOP
        # answers, which the gateway drops the connection for (the consumer resumes).
        await client.send(
            raw_dcp.control(b"connection_buffer_size", b"%d" % BUFFER, opaque=0xFFF0),
            raw_dcp.control(b"enable_noop", b"true", opaque=0xFFF1),
            raw_dcp.control(b"set_noop_interval", b"1", opaque=0xFFF2),
        )
        unacked = 0
        await client.send(*(self._request(vb) for vb in self.views))
        while True:
            await self.reading.wait()
            got = await client.next()
            if got is None:
                return
            if got.magic == raw_dcp.REQ and got.opcode == raw_dcp.NOOP:
                await client.send(raw_dcp.reply(got))
                continue
            if got.magic == raw_dcp.REQ and got.opcode in COUNTED:
                unacked += got.size
                if unacked >= BUFFER // 4:
                    await client.send(raw_dcp.buffer_ack(unacked))
                    unacked = 0
            vb = got.opaque - 1
            if vb not in self.views:
                continue
            if got.magic == raw_dcp.RES and got.opcode == raw_dcp.STREAM_REQ:
                await self._answered(client, vb, got)
            elif got.opcode == raw_dcp.STREAM_END:
                await client.send(self._request(vb))
            else:
                self._item(vb, got)

    async def _answered(self, client: raw_dcp.RawDcp, vb: int, got: raw_dcp.Reply) -> None:
        v = self.views[vb]
        if got.status == 0x23:  # ROLLBACK
            (to,) = struct.unpack(">Q", got.value)
            assert to < v.seqno, f"raw vb {vb}: ROLLBACK to {to} from {v.seqno}"
            self.rollbacks += 1
            v.rollback(to)
            await client.send(self._request(vb))
            return
        if got.status in (Status.NOT_MY_VBUCKET, Status.TEMPORARY_FAILURE):
            await trio.sleep(0.05)
            await client.send(self._request(vb))
            return
        assert got.status == 0, f"raw vb {vb}: STREAM_REQ answered 0x{got.status:x}"
        entries = [struct.unpack_from(">QQ", got.value, i) for i in range(0, len(got.value), 16)]
        known = {uuid for uuid, _ in entries}
        assert v.seqno == 0 or v.uuid in known, (
            f"raw vb {vb}: streams from {v.seqno} of history {v.uuid}, not in {entries}"
        )
        if entries:
            v.uuid = entries[0][0]

    def _item(self, vb: int, got: raw_dcp.Reply) -> None:
        v = self.views[vb]
        if got.opcode == raw_dcp.MARKER:
            start, end = struct.unpack_from(">QQ", got.extras)
            assert start <= end and end > v.seqno, (vb, start, end, v.seqno)
            v.snap = (start, end)
            return
        if got.opcode not in (raw_dcp.MUTATION, raw_dcp.DELETION, raw_dcp.EXPIRATION):
            return
        seqno, rev = struct.unpack_from(">QQ", got.extras)
        assert seqno > v.seqno, f"raw vb {vb}: seqno {seqno} after {v.seqno}"
        assert v.snap[0] <= seqno <= v.snap[1], f"raw vb {vb}: seqno {seqno} outside {v.snap}"
        value = got.value if got.opcode == raw_dcp.MUTATION else None
        item = (got.key, value, got.cas, rev)
        before = self.served.setdefault((vb, seqno), item)
        if before != item:
            where = self.where.get((vb, seqno))
            raise AssertionError(
                f"raw vb {vb} seqno {seqno} served as {before} ({where}), now as {item} "
                f"(session {self.sessions}, uuid {v.uuid}, snapshot {v.snap})"
            )
        self.where.setdefault((vb, seqno), f"session {self.sessions}, uuid {v.uuid}")
        v.items[seqno] = item
        v.seqno = seqno
        self.items += 1

    def live(self) -> State:
        return _live(self.views)


# -- TAP clients ---------------------------------------------------------------


class ChaosTapClient:
    """A 2.x TAP client that acks what asks for it and reconnects under its name.

    Registered: its replica is kept across connections (the front resumes from its
    acks). Not registered: each connection backfills, so it starts a new replica."""

    def __init__(self, port: Port, name: bytes, flags: ConnectFlags, *, registered: bool) -> None:
        self.port = port
        self.name = name
        self.flags = flags | (ConnectFlags.REGISTERED_CLIENT if registered else ConnectFlags(0))
        self.registered = registered
        self.replica = Replica()
        self.connections = 0
        self.refused = 0

    async def run(self) -> None:
        while True:
            try:
                tap = await TapClient.open(
                    self.port.port, TapConnect(self.name, self.flags, backfill_date=0)
                )
            except OSError:
                await trio.sleep(0.05)
                continue
            self.connections += 1
            if not self.registered:
                self.replica = Replica()
            try:
                await self._session(tap)
            except LINK_ERRORS:
                pass
            finally:
                await tap.aclose()
            await trio.sleep(0.05)

    async def _session(self, tap: TapClient) -> None:
        while (frame := await tap.next_frame()) is not None:
            if frame.magic == 0x81:  # the CONNECT refused (its name still streams)
                self.refused += 1
                return
            self.replica.apply([decode_frame(frame)])
            if asks_for_ack(frame):
                await tap.send(classic_reply(frame))

    def live(self) -> State:
        return {key: (cas, value) for key, (value, cas, _rev, _flags) in self.replica.items.items()}


# -- a peer that sends what no peer should -----------------------------------------


def bad_input(rng: random.Random, upr_front: bool) -> bytes:
    """Bytes a broken or hostile peer sends: the front must close that connection only."""
    choice = rng.randrange(5)
    if choice == 0:  # not the memcached binary protocol at all
        return bytes([rng.choice((0x00, 0x47, 0x16, 0xFF))]) + rng.randbytes(rng.randrange(40))
    if choice == 1:  # a header that announces a huge body, then nothing
        return raw_dcp.HEADER.pack(0x80, 0x53, 0, 48, 0, 0, 0x7FFFFFF0, 1, 0)
    if choice == 2:  # a request with extras longer than its body
        return (
            raw_dcp.HEADER.pack(0x80, 0x50 if upr_front else 0x40, 2, 40, 0, 0, 4, 1, 0) + b"ab\0\0"
        )
    if choice == 3 and upr_front:  # a stream request before OPEN
        return raw_dcp.stream_req(0, 1)
    if choice == 3:  # a TAP CONNECT whose flags ask for a checkpoint map it does not send
        return raw_dcp.frame(0x40, extras=struct.pack(">I", 0x4C), key=b"bad", value=b"\0\0\0\x05")
    # the valid start of a session, then random bytes after a response header's magic
    opening = raw_dcp.open_producer(b"bad") if upr_front else encode(TapConnect(b"bad"))
    return opening + b"\x81" + rng.randbytes(rng.randrange(8, 60))


async def send_bad_input(port: int, data: bytes) -> None:
    """Send ``data`` and read until the peer closes (or a second passes)."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return
    try:
        with trio.move_on_after(1.0):
            await stream.send_all(data)
            while await stream.receive_some(65536):
                pass
    except LINK_ERRORS:
        pass
    finally:
        await stream.aclose()
