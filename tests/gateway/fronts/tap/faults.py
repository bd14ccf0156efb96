"""What the TAP front's fault tests share: a proxy whose connections can be cut,
a TAP client that acks when asked but can hold its acks back, and the checks
of what a client received.

The trust rule the checks hold the front to: after any fault a TAP client sees
every item of its vbuckets at least once, in order per key (TAP is
at-least-once), and nothing it acked or was promised is lost.
"""

from __future__ import annotations

import contextlib
import time

import trio

from adapters.mcbp import Frame
from adapters.tap import OpaqueCode, TapDelete, TapEvent, TapMutation, decode_frame
from gateway.io.listen import bound_port
from gateway.node.store import Store
from tests.support.classic_tap import asks_for_ack, classic_reply
from tests.support.tap_client import TapClient, is_opaque

VBUCKETS = 4


class CutProxy:
    """A TCP relay to ``target`` on a loopback port; ``cut`` closes every
    connection relayed so far, both sides, as a lost network path or a node's
    dead process would (new connections are relayed again)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.cuts = 0
        self.accepted = 0
        self._scopes: list[trio.CancelScope] = []

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            task_status.started(bound_port(listeners))
            await trio.serve_listeners(self._relay, listeners, handler_nursery=nursery)

    async def _relay(self, client: trio.SocketStream) -> None:
        scope = trio.CancelScope()
        self._scopes.append(scope)
        self.accepted += 1
        with scope:
            server = await trio.open_tcp_stream("127.0.0.1", self.target)
            async with client, server, trio.open_nursery() as pair:
                pair.start_soon(_pump, client, server, pair.cancel_scope)
                pair.start_soon(_pump, server, client, pair.cancel_scope)

    def cut(self) -> None:
        self.cuts += 1
        scopes, self._scopes = self._scopes, []
        for scope in scopes:
            scope.cancel()


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
    try:
        while data := await src.receive_some(65536):
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()


class HoldingClient:
    """A classic 2.x TAP client (it acks the messages that ask, with the reply
    shape of 2.x's mc_bin_server) that can hold its acks back: while ``holding``
    it keeps reading but acks nothing, and ``release`` sends every held ack in
    the order the messages came. ``hold_at`` mutations in, it starts holding."""

    def __init__(self, tap: TapClient, *, hold_at: int | None = None) -> None:
        self.tap = tap
        self.hold_at = hold_at
        self.holding = False
        self.held: list[Frame] = []
        self.events: list[TapEvent] = []
        self.mutations = 0
        self.changed = trio.Event()
        self.closed = False
        self._sending = trio.Lock()
        self.acked_upto = 0
        """How many of ``events`` the acks sent so far cover."""

    async def run(self) -> None:
        # The test closed it, or an ack met the gateway's close.
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await self._read()
        self.closed = True
        self.changed.set()

    async def _read(self) -> None:
        while (frame := await self.tap.next_frame()) is not None:
            event = decode_frame(frame)
            self.events.append(event)
            if isinstance(event, TapMutation):
                self.mutations += 1
                if self.mutations == self.hold_at:
                    self.holding = True
            if asks_for_ack(frame):
                async with self._sending:
                    if self.holding:
                        self.held.append(frame)
                    else:
                        await self.tap.send(classic_reply(frame))
                        self.acked_upto = len(self.events)
            self.changed.set()
            self.changed = trio.Event()

    async def release(self, replies: bytes | None = None) -> None:
        """Stop holding: send every held ack in order (or ``replies`` instead)."""
        # Under the lock: these leave before any later ack.
        async with self._sending:
            self.holding = False
            held, self.held = self.held, []
            if replies is None:
                replies = b"".join(classic_reply(frame) for frame in held)
            await self.tap.send(replies)

    async def send(self, data: bytes) -> None:
        async with self._sending:
            await self.tap.send(data)

    async def wait_for(self, condition: object) -> None:
        while not condition():  # type: ignore[operator]
            await self.changed.wait()


def write_keys(store: Store, prefix: bytes, count: int, size: int = 100) -> list[bytes]:
    """``count`` new keys spread over the vbuckets, all written at once (one
    memory snapshot per vbucket, up to the node's batch, for a live stream)."""
    now = time.time()
    keys = [b"%s-%06d" % (prefix, i) for i in range(count)]
    for i, key in enumerate(keys):
        store.set(i % VBUCKETS, key, b"%s=%d;" % (key, 1) + b"v" * size, now=now)
    return keys


def versions_in_order(events: list[TapEvent]) -> dict[bytes, list[int]]:
    """Each key's versions as received (the rev seqno), which must never go back:
    a duplicate repeats a version, never brings an older one after a newer."""
    seen: dict[bytes, list[int]] = {}
    for event in events:
        if isinstance(event, TapMutation | TapDelete):
            history = seen.setdefault(event.key, [])
            rev = event.rev_seqno or 0
            assert not history or rev >= history[-1], (event.key, history, rev)
            history.append(rev)
    return seen


def resets(events: list[TapEvent]) -> list[int]:
    return [e.vbucket for e in events if is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM)]


def mutation_keys(events: list[TapEvent]) -> list[bytes]:
    return [e.key for e in events if isinstance(e, TapMutation)]
