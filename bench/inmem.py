"""In-memory upstreams for the benchmarks: they cost (almost) nothing to serve.

``UprSource`` is a UPR producer over pre-encoded streams: every vbucket's
stream (snapshot marker, items, STREAM_END) is encoded once before the clock
starts, and a STREAM_REQ only slices it. It answers what the gateway and a
relay's reader ask: STAT vbucket / vbucket-seqno, OPEN, CONTROL, STREAM_REQ,
BUFFER_ACK, NOOP answers; it honours the connection's flow-control buffer as
a 3.0 producer does (it stops once the buffer is full, and goes on as
BUFFER_ACKs return bytes).

In live mode (``rate``) it sends, per vbucket in turn, one MEMORY snapshot
marker per item with the item's send time in its value (``STAMP``), the
worst case of a 3.0 producer serving a consumer that keeps up.

``TapSource`` is a TAP producer over one pre-encoded backfill. In live mode
(``rate``) it then sends, per vbucket in turn, CHECKPOINT_START, the item
(its send time in its value) and CHECKPOINT_END, each checkpoint message
asking for an ack (a 2.x producer whose consumer keeps up), to every
connection that sent CONNECT.

``relay`` is a plain trio byte relay: every accepted connection is piped to
the target both ways; each figure of a front stands beside it.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import trio

from adapters import tap, upr
from adapters.mcbp import FrameReader, Magic, Opcode, encode_frame

RECEIVE = 256 * 1024
CHUNK = 64 * 1024
STAMP = struct.Struct(">d")
LIVE_VALUE = 100
UUID = 0x0BEEF
OPS = upr.DCP.opcodes
_STREAM_REQ = OPS[upr.Command.STREAM_REQ]
_BUFFER_ACK = OPS[upr.Command.BUFFER_ACKNOWLEDGEMENT]
# A live item's marker and mutation packed directly (what ``upr.encode`` makes of
# them, at a fraction of the cost, so the source keeps up at high rates).
_LIVE_MARKER = struct.Struct(">BBHBBHIIQQQI")
_LIVE_MUTATION = struct.Struct(">BBHBBHIIQQQIIIHB")
_MARKER = OPS[upr.Command.SNAPSHOT_MARKER]
_MUTATION = OPS[upr.Command.MUTATION]
_MEMORY = upr.SnapshotFlags.MEMORY.value


def item_key(vbucket: int, index: int) -> bytes:
    return b"key::%04d::%09d" % (vbucket, index)


@dataclass
class UprSource:
    """Pre-encoded UPR streams of ``items`` items over ``vbuckets`` vbuckets."""

    items: int
    value_size: int
    vbuckets: int
    streams: dict[int, bytes] = field(default_factory=dict)
    highs: dict[int, int] = field(default_factory=dict)
    offsets: dict[int, list[int]] = field(default_factory=dict)
    patched: dict[tuple[int, int], bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        value = b"v" * self.value_size
        for vb in range(self.vbuckets):
            count = self.items // self.vbuckets + (vb < self.items % self.vbuckets)
            self.highs[vb] = count
            self.streams[vb] = b"".join(
                upr.encode(
                    upr.Mutation(
                        key=item_key(vb, seqno), value=value, by_seqno=seqno, rev_seqno=1,
                        flags=0x01000000, cas=seqno, vbucket=vb, opaque=0,
                    )
                )
                for seqno in range(1, count + 1)
            )  # fmt: skip
            self.offsets[vb] = _offsets(self.streams[vb])

    def stats(self, group: bytes) -> list[tuple[bytes, bytes]]:
        if group == b"vbucket":
            return [(b"vb_%d" % vb, b"active") for vb in range(self.vbuckets)]
        if group == b"vbucket-seqno":
            out = []
            for vb in range(self.vbuckets):
                out.append((b"vb_%d:high_seqno" % vb, b"%d" % self.highs[vb]))
                out.append((b"vb_%d:uuid" % vb, b"%d" % UUID))
            return out
        return []


class FlowWindow:
    """The producer's view of one connection's flow-control buffer."""

    def __init__(self) -> None:
        self.size = 0
        self.used = 0
        self.room = trio.Event()

    def acked(self, count: int) -> None:
        self.used = max(0, self.used - count)
        self.room.set()
        self.room = trio.Event()  # every waiter woke; later ones wait on a fresh one

    async def take(self, count: int) -> None:
        while self.size and self.used + count > self.size and self.used:
            await self.room.wait()
        self.used += count


def _reply(opcode: int, opaque: int, *, key: bytes = b"", value: bytes = b"", extras=b"") -> bytes:
    return encode_frame(Magic.RESPONSE, opcode, opaque=opaque, key=key, value=value, extras=extras)


def _offsets(body: bytes) -> list[int]:
    """Start of every frame of ``body``, and its end."""
    out = []
    offset = 0
    while offset < len(body):
        out.append(offset)
        offset += 24 + int.from_bytes(body[offset + 8 : offset + 12], "big")
    out.append(offset)
    return out


def _patched(source: UprSource, vb: int, opaque: int) -> bytes:
    """The vbucket's stream with the stream's opaque in every frame (cached: the
    gateway asks with the same opaques run after run, so only a first run pays)."""
    key = (vb, opaque)
    cached = source.patched.get(key)
    if cached is None:
        body = bytearray(source.streams[vb])
        opaque_bytes = struct.pack(">I", opaque)
        for start in source.offsets[vb][:-1]:
            body[start + 12 : start + 16] = opaque_bytes
        cached = source.patched[key] = bytes(body)
    return cached


async def serve_upr(source: UprSource, stream: trio.SocketStream, live: LiveFeed | None) -> None:
    """One UPR connection to the in-memory producer."""
    reader = FrameReader()
    window = FlowWindow()
    send_lock = trio.Lock()

    async def send(data: bytes | memoryview) -> None:
        async with send_lock:
            await stream.send_all(data)

    async def serve_stream(vb: int, opaque: int, start: int, end: int) -> None:
        high = min(source.highs[vb], end)
        if start < high:
            marker = upr.encode(
                upr.SnapshotMarker(start + 1, high, upr.SnapshotFlags.DISK, opaque, vb)
            )
            await window.take(len(marker))
            await send(marker)
            body = memoryview(_patched(source, vb, opaque))
            offsets = source.offsets[vb]
            index = start
            step = max(1, CHUNK // (offsets[1] - offsets[0]))
            while index < high:
                upto = min(high, index + step)
                chunk = body[offsets[index] : offsets[upto]]
                await window.take(len(chunk))
                await send(chunk)
                index = upto
        if end <= high or live is None:
            end_frame = upr.encode(upr.StreamEnd(upr.StreamEndReason.OK, opaque, vb))
            await window.take(len(end_frame))
            await send(end_frame)
        else:
            sink.opaques[vb] = opaque

    sink = LiveSink(send, window)
    async with trio.open_nursery() as nursery:
        if live is not None:
            live.sinks.append(sink)
            nursery.start_soon(sink.run)
        try:
            await _serve_requests(source, stream, reader, window, send, serve_stream, nursery)
        finally:
            if live is not None:
                live.sinks.remove(sink)
        nursery.cancel_scope.cancel()


async def _serve_requests(source, stream, reader, window, send, serve_stream, nursery) -> None:  # type: ignore[no-untyped-def]
    while data := await stream.receive_some(RECEIVE):
        reader.receive_data(data)
        while (frame := reader.next_frame()) is not None:
            if not frame.is_request:
                continue  # NOOP answers
            if frame.opcode == Opcode.STAT:
                pairs = source.stats(frame.key)
                await send(
                    b"".join(_reply(Opcode.STAT, frame.opaque, key=k, value=v) for k, v in pairs)
                    + _reply(Opcode.STAT, frame.opaque)
                )
            elif frame.opcode == _BUFFER_ACK:
                window.acked(int.from_bytes(frame.extras, "big"))
            elif frame.opcode == _STREAM_REQ:
                request = upr.decode_frame(frame)
                assert isinstance(request, upr.StreamRequest)
                await send(upr.encode(upr.StreamRequestOk(((UUID, 0),), request.opaque)))
                nursery.start_soon(
                        serve_stream, request.vbucket, request.opaque,
                        request.start_seqno, request.end_seqno,
                    )  # fmt: skip
            elif frame.opcode == OPS[upr.Command.CONTROL]:
                if frame.key == b"connection_buffer_size":
                    window.size = int(frame.value)
                await send(_reply(frame.opcode, frame.opaque))
            else:  # OPEN and anything else: accepted
                await send(_reply(frame.opcode, frame.opaque))


class LiveSink:
    """One connection's live streams: their opaques and what waits to be sent.

    Each sink sends on its own task, so a slow reader (the gateway falling
    behind) never holds the items of another (the relay's reader)."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]], window: FlowWindow) -> None:
        self.send = send
        self.window = window
        self.opaques: dict[int, int] = {}
        self.pending: list[bytes] = []
        self.ready = trio.Event()

    def push(self, frames: list[bytes]) -> None:
        self.pending.extend(frames)
        self.ready.set()

    async def run(self) -> None:
        while True:
            await self.ready.wait()
            self.ready = trio.Event()
            data = b"".join(self.pending)
            self.pending.clear()
            await self.window.take(len(data))
            await self.send(data)


@dataclass
class LiveFeed:
    """Timestamped one-item snapshots at ``rate`` items/s to every live stream."""

    rate: float
    vbuckets: int
    start_seqno: int
    value_size: int = LIVE_VALUE
    sinks: list[LiveSink] = field(default_factory=list)

    async def run(self, total: int) -> int:
        batch = max(1, int(self.rate / 1000))
        started = time.perf_counter()
        sent = 0
        pad = b"v" * (self.value_size - STAMP.size)
        while sent < total:
            now = time.time()
            stamped = STAMP.pack(now) + pad
            out: dict[int, list[bytes]] = {id(sink): [] for sink in self.sinks}
            for _ in range(min(batch, total - sent)):
                vb = sent % self.vbuckets
                seqno = self.start_seqno + 1 + sent // self.vbuckets
                for sink in self.sinks:
                    opaque = sink.opaques.get(vb)
                    if opaque is None:
                        continue
                    key = b"live::%d" % sent
                    out[id(sink)].append(
                        _LIVE_MARKER.pack(
                            0x80, _MARKER, 0, 20, 0, vb, 20, opaque, 0,
                            seqno, seqno, _MEMORY,
                        )
                        + _LIVE_MUTATION.pack(
                            0x80, _MUTATION, len(key), 31, 0, vb, 31 + len(key) + len(stamped),
                            opaque, sent + 1, seqno, 1, 0, 0, 0, 0, 0,
                        )
                        + key
                        + stamped
                    )  # fmt: skip
                sent += 1
            for sink in self.sinks:
                sink.push(out.get(id(sink), []))
            ahead = sent / self.rate - (time.perf_counter() - started)
            if ahead > 0:
                await trio.sleep(ahead)
        return sent


async def relay(
    target: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """A plain byte relay: every accepted connection is piped to ``target`` both ways."""

    async def pipe(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
        while data := await source.receive_some(RECEIVE):
            await sink.send_all(data)

    async def serve(client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", target)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipe, client, upstream)
            nursery.start_soon(pipe, upstream, client)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, serve, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


async def relay_main(target: int) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay, target)
        print(f"relay on {port}", file=sys.stderr, flush=True)
        await trio.sleep_forever()


async def upr_source_main(items: int, value_size: int, vbuckets: int, rate: float) -> None:
    """Run the in-memory UPR producer; with ``rate``, feed live items after a start line."""
    source = UprSource(items, value_size, vbuckets)
    live = LiveFeed(rate, vbuckets, max(source.highs.values())) if rate else None

    async def handler(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await serve_upr(source, stream, live)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        print(f"upr source on {port}", file=sys.stderr, flush=True)
        if live is not None:
            # The benchmark says "go" on stdin once its readers are connected.
            await trio.to_thread.run_sync(sys.stdin.readline)
            total = int(sys.stdin.readline() or 0)
            sent = await live.run(total)
            print(f"live sent {sent}", file=sys.stderr, flush=True)
        await trio.sleep_forever()


class TapSource:
    """A TAP producer over one pre-encoded stream: every vbucket's backfill in turn.

    The stream is stamped once (sequence numbers from 1, ACK on every opaque
    message and every ``ACK_INTERVAL`` messages, as 2.x asked), so a CONNECT
    only sends slices of it; like 2.x it stops once ``ACK_WINDOW`` messages are
    unacked and goes on as acks come back."""

    ACK_INTERVAL = 1000
    ACK_WINDOW = int(os.environ.get("BENCH_ACK_WINDOW", "10000"))
    """2.x's window (``BENCH_ACK_WINDOW``: another, to see what the window costs)."""

    def __init__(self, items: int, value_size: int, vbuckets: int) -> None:
        self.vbuckets = vbuckets
        self.highs = {vb: items // vbuckets + (vb < items % vbuckets) for vb in range(vbuckets)}
        value = b"v" * value_size
        messages: list[tap.TapStreamMessage] = []
        for vb in range(vbuckets):
            messages.append(tap.TapOpaque(tap.OpaqueCode.INITIAL_VBUCKET_STREAM, vbucket=vb))
            messages.extend(
                tap.TapMutation(
                    item_key(vb, seqno), value, vbucket=vb, cas=seqno, rev_seqno=1, nru=0
                )
                for seqno in range(1, self.highs[vb] + 1)
            )
            messages.append(tap.TapOpaque(tap.OpaqueCode.CLOSE_BACKFILL, vbucket=vb))
        frames = []
        for seqno, message in enumerate(messages, 1):
            ack = type(message) is tap.TapOpaque or seqno % self.ACK_INTERVAL == 0
            flags = tap.TapFlags.ACK if ack else tap.TapFlags(0)
            frames.append(tap.encode(replace(message, opaque=seqno, tap_flags=flags)))
        self.frames = frames

    def stats(self, group: bytes) -> list[tuple[bytes, bytes]]:
        if group == b"vbucket":
            return [(b"vb_%d" % vb, b"active") for vb in range(self.vbuckets)]
        if group == b"vbucket-seqno":
            return [(b"vb_%d:high_seqno" % vb, b"%d" % h) for vb, h in self.highs.items()]
        return []


_OPAQUE_AT = 12  # header offset of the opaque, the TAP message's sequence number
_ID = struct.Struct(">Q")


class TapLiveFeed:
    """Timestamped one-item checkpoints at ``rate`` items/s to every connected TAP stream.

    Each vbucket's three messages are encoded once; per item the key, the
    value's stamp, the cas and the checkpoint id are patched into a copy
    (cheap enough that the producer never sets the pace), and each
    connection stamps its own sequence numbers after its backfill's."""

    KEY = b"live::%012d"

    def __init__(self, rate: float, vbuckets: int) -> None:
        self.rate = rate
        self.vbuckets = vbuckets
        self.sinks: list[Callable[[list[bytes]], None]] = []
        self.checkpoints = [0] * vbuckets
        ack = tap.TapFlags.ACK
        value = b"v" * LIVE_VALUE
        self.templates = [
            (
                tap.encode(tap.TapCheckpointStart(0, vbucket=vb, tap_flags=ack)),
                tap.encode(tap.TapMutation(self.KEY % 0, value, vbucket=vb, rev_seqno=1, nru=0)),
                tap.encode(tap.TapCheckpointEnd(0, vbucket=vb, tap_flags=ack)),
            )
            for vb in range(vbuckets)
        ]

    def frames(self, sent: int, stamp: bytes) -> bytes:
        vb = sent % self.vbuckets
        self.checkpoints[vb] += 1
        cp = _ID.pack(self.checkpoints[vb])
        start, item, end = self.templates[vb]
        key = self.KEY % sent
        mutation = bytearray(item)
        _ID.pack_into(mutation, 16, sent + 1)  # cas
        at = len(mutation) - LIVE_VALUE
        mutation[at - len(key) : at] = key
        mutation[at : at + STAMP.size] = stamp
        return b"".join((start[:-8], cp, mutation, end[:-8], cp))

    async def run(self, total: int) -> int:
        batch = max(1, int(self.rate / 1000))
        started = time.perf_counter()
        sent = 0
        while sent < total:
            stamp = STAMP.pack(time.time())
            out: list[bytes] = []
            for _ in range(min(batch, total - sent)):
                out.append(self.frames(sent, stamp))
                sent += 1
            for sink in self.sinks:
                sink(out)
            ahead = sent / self.rate - (time.perf_counter() - started)
            if ahead > 0:
                await trio.sleep(ahead)
        return sent


async def serve_tap(
    source: TapSource, stream: trio.SocketStream, live: TapLiveFeed | None = None
) -> None:
    """One connection to the in-memory TAP producer."""
    reader = FrameReader(lenient_responses=True)
    acked = 0
    room = trio.Event()
    frames = list(source.frames)
    more = trio.Event()

    def push(items: list[bytes]) -> None:
        # Each item is its three messages joined: a sequence number for each.
        for data in items:
            stamped = bytearray(data)
            at = 0
            while at < len(stamped):
                struct.pack_into(">I", stamped, at + _OPAQUE_AT, len(frames) + 1)
                at += 24 + int.from_bytes(stamped[at + 8 : at + 12], "big")
                frames.append(b"")  # placeholder: one sequence number per message
            frames[-1] = bytes(stamped)
        more.set()

    async def produce(name: str) -> None:
        nonlocal more
        sent = 0
        if live is not None:
            live.sinks.append(push)
        started = time.perf_counter()
        stalls, stalled = 0, 0.0  # waits on the ack window: the consumer acks too late
        while True:
            while sent < len(frames):
                if sent - acked >= TapSource.ACK_WINDOW:
                    stalls += 1
                    since = time.perf_counter()
                    while sent - acked >= TapSource.ACK_WINDOW:
                        await room.wait()
                    stalled += time.perf_counter() - since
                upto = min(len(frames), sent + 500, acked + TapSource.ACK_WINDOW)
                await stream.send_all(b"".join(frames[sent:upto]))
                sent = upto
            if live is None:
                took = time.perf_counter() - started
                print(
                    f"tap source, {name}: {sent:,} messages in {took * 1e3:.0f} ms, "
                    f"{stalled * 1e3:.1f} ms of it waiting {stalls} times on the ack window",
                    file=sys.stderr,
                    flush=True,
                )
                return
            await more.wait()
            more = trio.Event()

    async with trio.open_nursery() as nursery:
        while data := await stream.receive_some(RECEIVE):
            reader.receive_data(data)
            while (frame := reader.next_frame()) is not None:
                if not frame.is_request:
                    if frame.opaque > acked:  # an ack of everything up to it
                        acked = frame.opaque
                        room.set()
                        room = trio.Event()
                elif frame.opcode == Opcode.STAT:
                    pairs = source.stats(frame.key)
                    await stream.send_all(
                        b"".join(
                            _reply(Opcode.STAT, frame.opaque, key=k, value=v) for k, v in pairs
                        )
                        + _reply(Opcode.STAT, frame.opaque)
                    )
                elif frame.opcode == tap.TapOpcode.CONNECT:
                    nursery.start_soon(produce, frame.key.decode("utf-8", "replace"))
                else:  # NOOP, DEREGISTER and the like: accepted
                    await stream.send_all(_reply(frame.opcode, frame.opaque))
        nursery.cancel_scope.cancel()


async def tap_source_main(items: int, value_size: int, vbuckets: int, rate: float = 0.0) -> None:
    """Run the in-memory TAP producer; with ``rate``, feed live items after a start line."""
    source = TapSource(items, value_size, vbuckets)
    live = TapLiveFeed(rate, vbuckets) if rate else None

    async def handler(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await serve_tap(source, stream, live)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        print(f"tap source on {listeners[0].socket.getsockname()[1]}", file=sys.stderr, flush=True)
        if live is not None:
            # The benchmark says "go" on stdin once its readers are connected.
            await trio.to_thread.run_sync(sys.stdin.readline)
            total = int(sys.stdin.readline() or 0)
            sent = await live.run(total)
            print(f"live sent {sent}", file=sys.stderr, flush=True)


if __name__ == "__main__" and sys.argv[1] == "tap":
    trio.run(
        tap_source_main, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
        float(sys.argv[5]) if len(sys.argv) > 5 else 0.0,
    )  # fmt: skip
elif __name__ == "__main__":
    trio.run(
        upr_source_main, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
        float(sys.argv[4]) if len(sys.argv) > 4 else 0.0,
    )  # fmt: skip
