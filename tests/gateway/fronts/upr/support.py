"""Helpers of the UPR front's tests: a reference node upstream, the gateway, checks."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import trio

from adapters import upr
from adapters.mcbp import Status
from gateway.fronts.upr import UprFront, UprFrontConfig
from gateway.metrics.figures import GatewayStats
from gateway.node.items import ItemKind, StoreError
from gateway.node.store import Store
from tests.support.tap_client import start_node
from tests.support.upr_client import MAX_SEQNO, StreamLog, UprClient, until

VBUCKETS = 4

__all__ = [
    "MAX_SEQNO",
    "VBUCKETS",
    "StreamLog",
    "UprClient",
    "caught_up",
    "filled_store",
    "final_state",
    "open_producer",
    "start_front",
    "start_node",
    "store_state",
    "until",
    "write_load",
]


def filled_store(n: int = 40, **kwargs: Any) -> Store:
    """Writes, overwrites, deletes and soon-to-expire items in every vbucket."""
    store = Store(VBUCKETS, **kwargs)
    now = time.time()
    for vb in range(VBUCKETS):
        for i in range(n):
            store.set(vb, b"key-%d" % i, b"value-%d-%d" % (vb, i), flags=i, now=now)
        for i in range(0, n, 3):
            store.set(vb, b"key-%d" % i, b"again-%d" % i, now=now)
        for i in range(0, n, 7):
            store.delete(vb, b"key-%d" % i, now=now)
    return store


def config(state_dir: Path, node_port: int, **kw: Any) -> UprFrontConfig:
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


async def start_front(
    nursery: trio.Nursery,
    state_dir: Path,
    node_port: int,
    *,
    stats: GatewayStats | None = None,
    close_logs: bool = True,
    connected: bool = True,
    **kw: Any,
) -> tuple[UprFront, int, FrontScope]:
    """The gateway in its own cancel scope (cancel it to stop or "kill" it); with
    ``connected``, once its ingest opened the upstream's vbuckets' logs and sent
    CONNECT (it opens them in a worker thread, so a consumer could ask first)."""
    front = UprFront(config(state_dir, node_port, **kw), stats)
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


def store_state(store: Store, vb: int) -> dict[bytes, tuple[int, bytes | None]]:
    """Per key (cas, value or None when deleted), as the node holds it."""
    return {
        it.key: (it.cas, None if it.kind is not ItemKind.MUTATION else it.value)
        for it in store.items_since(vb, 0)
    }


def caught_up(front: UprFront, store: Store, *, live_only: bool = False) -> bool:
    """The gateway's index holds the node's versions (``live_only``: of live keys)."""
    for vb in range(VBUCKETS):
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


def final_state(log: StreamLog) -> dict[bytes, tuple[int, bytes | None]]:
    out: dict[bytes, tuple[int, bytes | None]] = {}
    for e in log.items:
        out[e.key] = (e.cas, e.value if isinstance(e, upr.Mutation) else None)
    return out


async def open_producer(port: int, name: bytes = b"consumer", flags: int = 0,
                        dialect: upr.Dialect = upr.DCP) -> UprClient:  # fmt: skip
    client = await UprClient.connect(port, dialect)
    if upr.Command.OPEN in dialect.opcodes:
        reply = await client.open(name, upr.OpenFlags.PRODUCER | flags)
        assert reply.status == Status.SUCCESS, reply
    return client


async def write_load(store: Store, n: int, *, seed: int = 1, pause_every: int = 50) -> None:
    """Concurrent writes on the node: sets, overwrites and deletes across vbuckets."""
    import random

    rng = random.Random(seed)
    for i in range(n):
        vb = rng.randrange(VBUCKETS)
        key = b"load-%d" % rng.randrange(60)
        now = time.time()
        if rng.random() < 0.2:
            with contextlib.suppress(StoreError):  # not there: nothing to delete
                store.delete(vb, key, now=now)
        else:
            with contextlib.suppress(StoreError):  # a vbucket taken over: refused
                store.set(vb, key, b"v%d" % i, now=now)
        if i % pause_every == 0:
            await trio.sleep(0.001)
