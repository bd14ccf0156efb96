"""The set-ups the front tests share: a front over an upstream, and its clients.

- ``tap_front_over_node``: a TAP front over a reference node (which it reads
  as a UPR consumer), ``tap_front_over_scripted`` over a scripted 3.0
  producer; ``TapRig.client`` connects a TAP client to it.
- ``upr_front_over_node``: a UPR front over a reference node (which it reads
  as a TAP client); ``UprRig.consumer`` opens a UPR consumer on it.
- ``start_upr_front``: the UPR front alone in its own cancel scope, over any
  TAP upstream; ``upr_front_over_251`` over a scripted 2.5.1 producer;
  ``served_items`` reads what one of its vbuckets serves a UPR consumer.
- ``serve_tap_side`` / ``serve_upr_side``: the node itself or a front over it,
  for the client tests that run on both sides (the node is the front's test
  peer, so a misreading both share would otherwise pass).

Every server listens on a free loopback port; the fronts get fast backoff and
NOOPs unless the test says otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from adapters import upr
from adapters.mcbp import Status
from adapters.tap import ConnectFlags
from gateway.fronts.tap.server import TapFront
from gateway.fronts.upr import UprFront, UprFrontConfig
from gateway.metrics.figures import GatewayStats
from gateway.node.items import ItemKind
from gateway.node.server import Node
from gateway.node.store import Store
from tests.support import tap_client, upr_client
from tests.support.scripted_upr import ScriptedUpr
from tests.support.tap251 import STREAMED, Tap251Node
from tests.support.tap_client import NO_FLAGS, TapClient, connect_event
from tests.support.tapfront import start_front as start_tap_front
from tests.support.upr_client import UprClient
from tests.support.waiting import until

CAUGHT_UP_VBUCKETS = 4
"""The vbuckets ``caught_up`` compares, and ``filled`` fills: the tests' stores have four."""

# -- the TAP front ----------------------------------------------------------------


@dataclass
class TapRig:
    """A TAP front (on ``port``) over an upstream on ``upstream_port``: a reference
    node (``node``) or a scripted 3.0 producer (``node`` None)."""

    front: TapFront
    port: int
    upstream_port: int
    node: Node | None = None

    @property
    def store(self) -> Store:
        assert self.node is not None, "a scripted upstream has no store"
        return self.node.store

    async def client(
        self, name: bytes, flags: ConnectFlags = NO_FLAGS, **connect: Any
    ) -> TapClient:
        """A TAP client connected to the front with CONNECT(``name``, ``flags``);
        ``connect``: ``backfill_date``, ``vbuckets``, ... (``connect_event``)."""
        return await TapClient.open(self.port, connect_event(name, flags, **connect))


async def tap_front_over_node(
    nursery: trio.Nursery,
    store: Store | None = None,
    *,
    node: dict[str, Any] | None = None,
    **front: Any,
) -> TapRig:
    """A reference node serving ``store`` (``node``: ``NodeConfig`` fields) and a
    TAP front over it (``front``: ``state_dir`` and ``TapFrontConfig`` fields)."""
    served, node_port = await tap_client.start_node(nursery, store, **(node or {}))
    tap_front, port = await start_tap_front(nursery, node_port, **front)
    return TapRig(tap_front, port, node_port, served)


async def tap_front_over_scripted(nursery: trio.Nursery, upr: ScriptedUpr, **front: Any) -> TapRig:
    """A scripted 3.0 producer and a TAP front over it (``front`` as above)."""
    upr_port = await nursery.start(upr.serve)
    tap_front, port = await start_tap_front(nursery, upr_port, **front)
    return TapRig(tap_front, port, upr_port)


# -- the UPR front ----------------------------------------------------------------


def upr_front_config(state_dir: Path, node_port: int, **kw: Any) -> UprFrontConfig:
    """The UPR front's config for tests: no compaction, a fixed seed, fast reconnects."""
    kw.setdefault("compact_interval", 0)
    kw.setdefault("seed", 7)
    kw.setdefault("reconnect_min", 0.02)
    kw.setdefault("reconnect_max", 0.2)
    return UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", node_port), state_dir, **kw)


class FrontScope:
    """The cancel scope a test front runs in, and when it has stopped."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()

    def cancel(self) -> None:
        self.scope.cancel()

    async def stop(self) -> None:
        """Cancel (no clean close: as if killed) and wait until every task of it ended."""
        self.scope.cancel()
        await self.stopped.wait()


async def start_upr_front(
    nursery: trio.Nursery,
    state_dir: Path,
    node_port: int,
    *,
    stats: GatewayStats | None = None,
    close_logs: bool = True,
    connected: bool = True,
    **kw: Any,
) -> tuple[UprFront, int, FrontScope]:
    """The UPR front in its own cancel scope (cancel it to stop or "kill" it); with
    ``connected``, once its ingest opened the upstream's vbuckets' logs and sent
    CONNECT (it opens them in a worker thread, so a consumer could ask first)."""
    front = UprFront(upr_front_config(state_dir, node_port, **kw), stats)
    running = FrontScope()

    async def run(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with running.scope:
                await front.run(close_logs=close_logs, task_status=task_status)
        finally:
            running.stopped.set()

    port = await nursery.start(run)
    if connected:
        with trio.fail_after(10):
            await front.ingest.connected.wait()
    return front, port, running


async def open_consumer(port: int, name: bytes = b"consumer", flags: int = 0,
                        dialect: upr.Dialect = upr.DCP) -> UprClient:  # fmt: skip
    """A UPR consumer of the server on ``port``: connected and, where the dialect
    has OPEN, opened as ``name`` (PRODUCER | ``flags``)."""
    client = await UprClient.connect(port, dialect)
    if upr.Command.OPEN in dialect.opcodes:
        reply = await client.open(name, upr.OpenFlags.PRODUCER | flags)
        assert reply.status == Status.SUCCESS, reply
    return client


@dataclass
class UprRig:
    """A UPR front (on ``port``, stopped with ``running``) over a reference node."""

    node: Node
    node_port: int
    front: UprFront
    port: int
    running: FrontScope

    @property
    def store(self) -> Store:
        return self.node.store

    async def consumer(self, name: bytes = b"consumer", flags: int = 0,
                       dialect: upr.Dialect = upr.DCP) -> UprClient:  # fmt: skip
        """A UPR consumer opened on the front (``open_consumer``)."""
        return await open_consumer(self.port, name, flags, dialect)

    async def catch_up(self, seconds: float = 10) -> None:
        """Until the front's log holds what the node holds (``caught_up``), failing
        after ``seconds``."""
        with trio.fail_after(seconds):
            await until(lambda: caught_up(self.front, self.store))


async def upr_front_over_node(
    nursery: trio.Nursery,
    state_dir: Path,
    store: Store | None = None,
    *,
    node: dict[str, Any] | None = None,
    **front: Any,
) -> UprRig:
    """A reference node serving ``store`` (``node``: ``NodeConfig`` fields) and a
    UPR front over it (``front``: ``start_upr_front``'s options and config fields)."""
    served, node_port = await tap_client.start_node(nursery, store, **(node or {}))
    upr_front, port, running = await start_upr_front(nursery, state_dir, node_port, **front)
    return UprRig(served, node_port, upr_front, port, running)


async def upr_front_over_251(
    nursery: trio.Nursery, state_dir: Path, node: Tap251Node, **front: Any
) -> tuple[UprFront, int]:
    """A scripted 2.5.1 TAP producer and a UPR front over it streaming its vbuckets
    ``STREAMED`` (``front``: ``start_upr_front``'s options and config fields)."""
    node_port = await node.start(nursery)
    upr_front, port, _ = await start_upr_front(
        nursery, state_dir, node_port, vbuckets=STREAMED, **front
    )
    return upr_front, port


def items_of(events: list[upr.UprEvent]) -> list[upr.UprEvent]:
    """The item messages among ``events``."""
    return [e for e in events if isinstance(e, upr.Mutation | upr.Deletion | upr.Expiration)]


async def served_items(front_port: int, vb: int, count: int) -> list[upr.UprEvent]:
    """The first ``count`` items (and markers) a UPR consumer is served from ``vb``."""
    client = await UprClient.connect(front_port)
    try:
        assert (await client.open(b"reader-%d" % vb)).status == 0
        reply = await client.stream_request(vb)
        assert reply.status == 0, reply
        events: list[upr.UprEvent] = []
        while len(items_of(events)) < count:
            event = await client.receive()
            await client.answer(event)
            if not isinstance(event, upr.Noop) and not event.IS_RESPONSE:
                events.append(event)
        return events
    finally:
        await client.aclose()


# -- either side ------------------------------------------------------------------


def filled(items: int, *, removals: bool = False) -> Store:
    """A 4-vbucket store of ``items`` keys spread over the vbuckets; with ``removals``,
    an expired item and a deletion in vbucket 0."""
    store = Store(CAUGHT_UP_VBUCKETS)
    now = time.time()
    for i in range(items):
        store.set(i % CAUGHT_UP_VBUCKETS, b"key-%06d" % i, b"v%d" % i, now=now)
    if removals:
        store.set(0, b"expires", b"x", expiration=int(now), now=now)
        store.delete(0, b"key-%06d" % 0, now=now)
    return store


def high_seqno(server: Any, vbucket: int) -> int:
    """The vbucket's high seqno as ``server`` numbers it (the UPR front keeps its own)."""
    logs = getattr(server, "logs", None)
    if logs is not None:
        return int(logs.logs[vbucket].high_seqno)
    return int(server.store.high_seqno(vbucket))


async def serve_tap_side(nursery: trio.Nursery, store: Store, side: str) -> tuple[Any, int]:
    """The node, or a TAP front over it: (the server, its TAP port)."""
    if side == "node":
        return await tap_client.start_node(nursery, store)
    rig = await tap_front_over_node(nursery, store)
    return rig.front, rig.port


async def serve_upr_side(
    nursery: trio.Nursery, store: Store, side: str, state_dir: Path
) -> tuple[Any, int]:
    """The node, or a UPR front caught up with it: (the server, its port)."""
    node, node_port = await upr_client.start_node(nursery, store)
    if side == "node":
        return node, node_port
    front, port, _ = await start_upr_front(nursery, state_dir, node_port)
    with trio.fail_after(20):
        await until(lambda: caught_up(front, store))
    return front, port


def store_state(store: Store, vb: int) -> dict[bytes, tuple[int, bytes | None]]:
    """Per key (cas, value or None when deleted), as the node holds it."""
    return {
        it.key: (it.cas, None if it.kind is not ItemKind.MUTATION else it.value)
        for it in store.items_since(vb, 0)
    }


def caught_up(front: UprFront, store: Store, *, live_only: bool = False) -> bool:
    """The front's index holds the node's versions of vbuckets 0-3 (``live_only``:
    of live keys)."""
    for vb in range(CAUGHT_UP_VBUCKETS):
        vblog = front.logs.get(vb)
        if vblog is None or vblog.high_seqno != vblog.translator.high_seqno:
            return False
        t = vblog.translator
        index = {k: v for k in t.index if (v := t.version(k)) is not None}
        want = store_state(store, vb)
        if live_only:
            index = {k: v for k, v in index.items() if not v.deleted}
            want = {k: v for k, v in want.items() if v[1] is not None}
        got = {k: v.cas for k, v in index.items()}
        if got != {k: cas for k, (cas, _) in want.items()}:
            return False
        if any(index[k].deleted != (v is None) for k, (_, v) in want.items()):
            return False
    return True
