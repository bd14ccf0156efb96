"""A small TAP client for the node's TAP tests: connect, read events, ack.

``TapClient`` speaks raw frames over a trio stream so a test can see exactly
what the node sent (``frames``) or the decoded events (``next_event``).
``collect`` reads until a predicate holds or the node closes, acking every
message that asks for one when ``auto_ack`` is set.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import trio
import trio.testing

from adapters.mcbp import Frame, FrameReader
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapConnect,
    TapEvent,
    TapFlags,
    TapOpaque,
    TapResponse,
    TapStreamMessage,
    decode_frame,
    encode,
)
from adapters.tap.acks import ACK_OPCODES, ack_opcode
from tests.support.waiting import until as until  # re-exported for the tests

STREAM_TYPES = tuple(ACK_OPCODES)
FUTURE = (1 << 64) - 1
"""Backfill date in the future (all ones): new changes only."""
NO_FLAGS = ConnectFlags(0)


opcode_of = ack_opcode


def wants_ack(event: TapEvent) -> bool:
    return isinstance(event, STREAM_TYPES) and bool(event.tap_flags & TapFlags.ACK)  # type: ignore[union-attr]


def is_opaque(event: TapEvent, code: OpaqueCode, vbucket: int | None = None) -> bool:
    return (
        isinstance(event, TapOpaque)
        and event.opaque_code == code
        and (vbucket is None or event.vbucket == vbucket)
    )


def connect_event(
    name: bytes = b"",
    flags: ConnectFlags = NO_FLAGS,
    *,
    backfill_date: int | None = None,
    vbuckets: tuple[int, ...] = (),
    checkpoints: tuple[tuple[int, int], ...] = (),
) -> TapConnect:
    return TapConnect(
        name,
        flags,
        backfill_date=backfill_date,
        vbuckets=vbuckets,
        checkpoints=checkpoints,
    )


class TapClient:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.reader = FrameReader()
        self.closed = False

    @classmethod
    async def open(cls, port: int, connect: TapConnect | None = None) -> TapClient:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        if connect is not None:
            await client.send(encode(connect))
        return client

    async def __aenter__(self) -> TapClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def next_frame(self) -> Frame | None:
        """The next frame, ``None`` once the node closed the connection."""
        while True:
            frame = self.reader.next_frame()
            if frame is not None:
                return frame
            if self.closed:
                return None
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                self.closed = True
                continue
            self.reader.receive_data(data)

    async def next_event(self) -> TapEvent | None:
        frame = await self.next_frame()
        return None if frame is None else decode_frame(frame)

    async def message(self) -> TapStreamMessage:
        """The next event, which must be a stream message."""
        event = await self.next_event()
        assert isinstance(event, STREAM_TYPES), event
        return event  # type: ignore[return-value]

    async def ack(self, event: TapStreamMessage, status: int = 0, text: bytes = b"") -> None:
        await self.send(encode(TapResponse(opcode_of(event), event.opaque, status, text)))

    async def collect(
        self,
        until: Callable[[TapEvent], bool] | None = None,
        *,
        auto_ack: bool = True,
    ) -> list[TapEvent]:
        """Events up to and including the first matching ``until`` (or the close)."""
        events: list[TapEvent] = []
        while (event := await self.next_event()) is not None:
            events.append(event)
            if auto_ack and wants_ack(event):
                await self.ack(event)  # type: ignore[arg-type]
            if until is not None and until(event):
                break
        return events


async def start_node(nursery: trio.Nursery, store: Any = None, **config: Any) -> tuple[Any, int]:
    """A reference node on a free loopback port: (node, port).

    ``store`` defaults to an empty 4-vbucket store; ``config`` are
    ``NodeConfig`` fields (fast NOOPs and backoff unless given).
    """
    from gateway.io.listen import bound_port
    from gateway.node.server import Node, NodeConfig
    from gateway.node.store import Store

    config.setdefault("vbuckets", 4)
    config.setdefault("tap_noop_interval", 0.5)
    config.setdefault("tap_backoff", 0.05)
    if store is None:
        store = Store(config["vbuckets"])
    node = Node(store, NodeConfig(**config))
    if not any(hook == node.changes.notify for hook in getattr(store, "_listeners", [])):
        store.add_listener(node.changes.notify)
    listeners = await nursery.start(node.serve, "127.0.0.1", 0)
    return node, bound_port(listeners)
