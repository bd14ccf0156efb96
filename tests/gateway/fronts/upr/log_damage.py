"""Helpers of the damaged-log tests: run the gateway, record what consumers were given.

A consumer's view is kept as versions by (vbucket, uuid, seqno): the rule
under test is that no such triple ever names two different versions, across
restarts and damage, and that consumers end with exactly the node's data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from adapters import upr
from gateway.fronts.upr import UprFront
from gateway.metrics.figures import GatewayStats
from gateway.node.store import Store
from tests.gateway.fronts.upr.support import (
    VBUCKETS,
    StreamLog,
    caught_up,
    config,
    open_producer,
    until,
)

Version = tuple[bytes, int, bool]
"""(key, cas, deleted)."""


@dataclass
class Running:
    front: UprFront
    port: int
    scope: trio.CancelScope
    done: trio.Event

    async def stop(self) -> None:
        """Cancel the gateway and wait until it has closed its logs."""
        self.scope.cancel()
        await self.done.wait()


async def start(
    nursery: trio.Nursery,
    state_dir: Path,
    node_port: int,
    *,
    stats: GatewayStats | None = None,
    close_logs: bool = True,
    **kw: Any,
) -> Running:
    front = UprFront(config(state_dir, node_port, **kw), stats)
    scope = trio.CancelScope()
    done = trio.Event()

    async def run(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await front.run(close_logs=close_logs, task_status=task_status)
        finally:
            done.set()

    port = await nursery.start(run)
    with trio.fail_after(10):  # the ingest opened the logs (in a worker thread) and connected
        await front.ingest.connected.wait()
    return Running(front, port, scope, done)


async def settled(front: UprFront, store: Store) -> None:
    with trio.fail_after(20):
        await until(lambda: caught_up(front, store))


@dataclass
class Consumer:
    """What one consumer holds: its position per vbucket and every version it was given."""

    positions: dict[int, tuple[int, int]] = field(default_factory=dict)
    """vb -> (uuid, last seqno received)."""
    logs: dict[int, StreamLog] = field(default_factory=dict)
    versions: dict[tuple[int, int, int], Version] = field(default_factory=dict)

    def note(self, vb: int, uuid: int, log: StreamLog) -> None:
        for e in log.items:
            version = (e.key, e.cas, not isinstance(e, upr.Mutation))
            seen = self.versions.setdefault((vb, uuid, e.by_seqno), version)
            assert seen == version, f"vb {vb}: ({uuid}, {e.by_seqno}) names {seen} and {version}"

    def state(self, vb: int) -> dict[bytes, tuple[int, bytes | None]]:
        out: dict[bytes, tuple[int, bytes | None]] = {}
        for e in self.logs[vb].items:
            out[e.key] = (e.cas, e.value if isinstance(e, upr.Mutation) else None)
        return out


async def catch_up(
    consumer: Consumer, front: UprFront, port: int, name: bytes = b"keeper"
) -> dict[int, upr.UprResponse]:
    """Resume every vbucket from the consumer's position up to the gateway's high seqno.

    A rollback answer (to 0, as the gateway only ever asks for) makes the
    consumer drop that vbucket and stream it again from 0. Returns the
    first answer per vbucket.
    """
    client = await open_producer(port, name)
    answers = {}
    for vb in range(VBUCKETS):
        vblog = front.logs.logs[vb]
        uuid, start_at = consumer.positions.get(vb, (0, 0))
        reply = await client.stream_request(vb, start_at, vblog.high_seqno, uuid=uuid, opaque=1)
        answers[vb] = reply
        if isinstance(reply, upr.StreamRequestRollback):
            assert reply.rollback_seqno == 0, reply
            consumer.logs.pop(vb, None)
            start_at = 0
            reply = await client.stream_request(vb, 0, vblog.high_seqno, opaque=2)
        assert isinstance(reply, upr.StreamRequestOk), reply
        history = reply.failover_log[0][0]
        log = await client.read_stream(reply.opaque)
        end = log.end
        assert end is not None and end.reason == upr.StreamEndReason.OK, end
        consumer.note(vb, history, log)
        held = consumer.logs.setdefault(vb, StreamLog())
        held.events += log.events
        last = log.items[-1].by_seqno if log.items else start_at
        consumer.positions[vb] = (history, last)
    await client.aclose()
    return answers


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
