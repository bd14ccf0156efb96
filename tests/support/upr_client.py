"""A UPR peer for tests: open a connection, request streams, read them whole.

``UprClient`` speaks either dialect over a trio stream. ``request`` sends a
request and returns its response, keeping anything else that arrives
meanwhile (stream messages, NOOPs) for ``receive``. ``read_stream`` collects
one stream's messages up to its STREAM_END, answering what a consumer must
answer on the way (NOOPs, snapshot markers with the ACK flag,
SET_VBUCKET_STATE) and, when ``ack_buffer`` is set, acknowledging every
counted message's bytes as it goes.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from adapters import upr
from adapters.mcbp import Frame, FrameReader
from adapters.mcbp.constants import Status
from adapters.upr.flow_control import is_counted
from tests.support.waiting import until as until  # re-exported for the tests

MAX_SEQNO = 0xFFFFFFFFFFFFFFFF
ITEM_EVENTS = (upr.Mutation, upr.Deletion, upr.Expiration)


@dataclass
class Received:
    """One decoded message and the frame it came in."""

    event: upr.UprEvent
    frame: Frame

    @property
    def size(self) -> int:
        return self.frame.size


@dataclass
class StreamLog:
    """Everything one stream delivered, in order."""

    events: list[upr.UprEvent] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    """The frame of each event, for checks of the wire layout."""

    @property
    def items(self) -> list[upr.Mutation | upr.Deletion | upr.Expiration]:
        return [e for e in self.events if isinstance(e, ITEM_EVENTS)]

    @property
    def markers(self) -> list[upr.SnapshotMarker]:
        return [e for e in self.events if isinstance(e, upr.SnapshotMarker)]

    @property
    def end(self) -> upr.StreamEnd | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, upr.StreamEnd) else None

    def states(self) -> list[upr.VBucketState]:
        return [e.state for e in self.events if isinstance(e, upr.SetVbucketState)]


class UprClient:
    def __init__(self, stream: trio.abc.Stream, dialect: upr.Dialect = upr.DCP) -> None:
        self.stream = stream
        self.dialect = dialect
        self.reader = FrameReader()
        self.pending: deque[Received] = deque()
        self._opaques = itertools.count(0x1000)
        self._sending = trio.Lock()
        self.unacked = 0
        """Counted bytes received and not yet acknowledged."""
        # The draft's consumers do not answer SET_VBUCKET_STATE.
        self.acks_states = upr.Command.SNAPSHOT_MARKER in dialect.opcodes

    @classmethod
    async def connect(cls, port: int, dialect: upr.Dialect = upr.DCP) -> UprClient:
        return cls(await trio.open_tcp_stream("127.0.0.1", port), dialect)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    def next_opaque(self) -> int:
        return next(self._opaques)

    # -- raw I/O -------------------------------------------------------------

    async def send(self, *events: upr.UprEvent) -> None:
        await self.send_raw(b"".join(upr.encode(e, self.dialect) for e in events))

    async def send_raw(self, data: bytes) -> None:
        async with self._sending:  # a relay may send from two tasks
            await self.stream.send_all(data)

    async def _read(self) -> Received | None:
        while True:
            frame = self.reader.next_frame()
            if frame is not None:
                event = upr.decode_frame(frame, self.dialect)
                if is_counted(getattr(event, "NAME", ""), event.IS_RESPONSE):
                    self.unacked += frame.size
                return Received(event, frame)
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.reader.receive_data(data)

    async def receive(self) -> upr.UprEvent:
        """The next message (kept ones first); ``EOFError`` once the server closed."""
        received = await self.receive_sized()
        return received.event

    async def receive_sized(self) -> Received:
        if self.pending:
            return self.pending.popleft()
        received = await self._read()
        if received is None:
            raise EOFError("server closed the connection")
        return received

    async def closed_by_server(self) -> bool:
        """Read until end of stream; whether the server closed (vs sending more)."""
        try:
            while True:
                await self.receive()
        except EOFError:
            return True
        except trio.BrokenResourceError:
            return True

    # -- requests --------------------------------------------------------------

    async def request(self, event: upr.UprRequest) -> upr.UprResponse:
        """Send ``event`` and return the response with its opaque."""
        await self.send(event)
        while True:
            received = await self._read()
            if received is None:
                raise EOFError(f"server closed the connection before answering {event.NAME}")
            got = received.event
            if got.IS_RESPONSE and got.opaque == event.opaque:
                return got  # type: ignore[return-value]
            self.pending.append(received)

    async def open(self, name: bytes, flags: int = upr.OpenFlags.PRODUCER) -> upr.UprResponse:
        return await self.request(
            upr.Open(name=name, flags=upr.OpenFlags(flags), opaque=self.next_opaque())
        )

    async def control(self, key: str, value: str) -> upr.UprResponse:
        return await self.request(
            upr.Control(key.encode(), value.encode(), opaque=self.next_opaque())
        )

    async def stream_request(
        self,
        vbucket: int,
        start: int = 0,
        end: int = MAX_SEQNO,
        uuid: int = 0,
        snap: tuple[int, int] | None = None,
        flags: int = 0,
        opaque: int | None = None,
    ) -> upr.UprResponse:
        snap_start, snap_end = snap if snap is not None else (start, start)
        if not self.dialect.stream_request.snapshot_range:
            snap_start = snap_end = 0
        return await self.request(
            upr.StreamRequest(
                flags=upr.StreamFlags(flags),
                start_seqno=start,
                end_seqno=end,
                vbucket_uuid=uuid,
                snap_start_seqno=snap_start,
                snap_end_seqno=snap_end,
                opaque=self.next_opaque() if opaque is None else opaque,
                vbucket=vbucket,
            )
        )

    async def failover_log(self, vbucket: int) -> upr.UprResponse:
        return await self.request(upr.GetFailoverLog(opaque=self.next_opaque(), vbucket=vbucket))

    async def ack_buffer(self, size: int | None = None) -> None:
        """BUFFER_ACKNOWLEDGEMENT for ``size`` bytes (default: all unacknowledged)."""
        size = self.unacked if size is None else size
        self.unacked -= size
        await self.send(upr.BufferAcknowledgement(size, opaque=self.next_opaque()))

    # -- consuming -------------------------------------------------------------

    async def answer(self, event: upr.UprEvent) -> None:
        """What a consumer must answer: NOOP, acked markers, SET_VBUCKET_STATE."""
        ok = Status.SUCCESS.value
        if isinstance(event, upr.Noop):
            await self.send(upr.Response(upr.Command.NOOP, event.opaque, ok))
        elif isinstance(event, upr.SetVbucketState) and self.acks_states:
            await self.send(upr.Response(upr.Command.SET_VBUCKET_STATE, event.opaque, ok))
        elif isinstance(event, upr.SnapshotMarker) and event.flags & upr.SnapshotFlags.ACK:
            # Acknowledged at once: a test consumer applies nothing it could lose.
            await self.send(upr.Response(upr.Command.SNAPSHOT_MARKER, event.opaque, ok))

    def take_pending(self, opaque: int, log: StreamLog | None = None) -> StreamLog:
        """The stream messages tagged ``opaque`` that arrived before the last
        response ``request`` returned (after a CLOSE_STREAM: all there will be)."""
        log = log or StreamLog()
        kept = [r for r in self.pending if getattr(r.event, "opaque", None) != opaque
                or r.event.IS_RESPONSE]  # fmt: skip
        for r in self.pending:
            if r not in kept:
                log.events.append(r.event)
                log.frames.append(r.frame)
        self.pending = deque(kept)
        return log

    async def read_stream(
        self, opaque: int, *, ack_buffer: bool = False, log: StreamLog | None = None
    ) -> StreamLog:
        """Messages of the stream tagged ``opaque`` up to its STREAM_END.

        Messages of other streams are kept for later ``receive`` calls.
        """
        log = log or StreamLog()
        others: list[Received] = []
        try:
            while True:
                received = await self.receive_sized()
                event = received.event
                await self.answer(event)
                if ack_buffer and self.unacked:
                    await self.ack_buffer()
                if isinstance(event, upr.Noop) or event.IS_RESPONSE:
                    continue
                if event.opaque != opaque:
                    others.append(received)
                    continue
                log.events.append(event)
                log.frames.append(received.frame)
                if isinstance(event, upr.StreamEnd):
                    return log
        finally:
            self.pending.extendleft(reversed(others))


def check_snapshots(log: StreamLog) -> None:
    """Every item sits under a marker whose range holds it; seqnos only grow;
    markers bracket their items exactly; no key twice within a snapshot."""
    current: upr.SnapshotMarker | None = None
    seen: list[int] = []
    keys: set[bytes] = set()
    last = -1

    def close() -> None:
        if current is not None:
            assert seen, f"empty snapshot {current}"
            assert (current.start_seqno, current.end_seqno) == (seen[0], seen[-1]), (
                current,
                seen,
            )

    for event in log.events:
        if isinstance(event, upr.SnapshotMarker):
            close()
            current, seen, keys = event, [], set()
        elif isinstance(event, ITEM_EVENTS):
            assert current is not None, f"item before any marker: {event}"
            assert event.by_seqno > last, "seqnos must grow"
            assert event.key not in keys, f"{event.key!r} twice in one snapshot"
            last = event.by_seqno
            seen.append(event.by_seqno)
            keys.add(event.key)
    close()


# -- nodes ----------------------------------------------------------------------


async def start_node(nursery: trio.Nursery, store: Any = None, **config: Any) -> tuple[Any, int]:
    """A reference node served on a free loopback port: (node, port).

    ``store`` defaults to an empty 4-vbucket store; ``config`` are
    ``NodeConfig`` fields.
    """
    from gateway.io.listen import bound_port
    from gateway.node.server import Node, NodeConfig
    from gateway.node.store import Store

    config.setdefault("vbuckets", 4)
    if store is None:
        store = Store(config["vbuckets"])
    node = Node(store, NodeConfig(**config))
    listeners = await nursery.start(node.serve, "127.0.0.1", 0)
    return node, bound_port(listeners)
