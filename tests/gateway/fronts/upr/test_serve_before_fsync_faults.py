"""Fault injection against fsync batch's early publish, with the gateway in a process.

The gateway runs as a child process (``GATEWAY``) whose segment fsyncs go
through a hook: each one that returns writes the size it covered to a
journal, and once the test creates the hold file every fsync blocks for
good (a disk that stopped answering). The test then SIGKILLs the child and
cuts every segment back to the size its last fsync covered (what a power
loss leaves: the page cache's unsynced bytes never reach the disk).

The rules checked: everything the TAP node was acked for is in the log; the
consumer that was served items the crash took back gets ROLLBACK by 3.0's
rule (ep-engine 3.0 ``src/failover-table.cc``, ``FailoverTable::needsRollback``)
against the failover entry the restart adds at the proven end (3.0's warmup
after an unclean shutdown, ``src/warmup.cc``), and after rolling back it
converges to exactly the node's data, with no seqno it saw reused.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import trio

from adapters import upr
from adapters.translate.tap_to_upr import TapToUpr
from gateway.fronts.upr.proof import prove_vbucket
from gateway.node.server import Node
from gateway.node.store import Store
from tests.gateway.fronts.upr.support import (
    MAX_SEQNO,
    VBUCKETS,
    StreamLog,
    UprClient,
    caught_up,
    filled_store,
    final_state,
    open_producer,
    start_front,
    start_node,
    store_state,
    until,
)
from tests.support.children import start_listening

GATEWAY = """
import os, sys, threading, trio
from pathlib import Path
from gateway.fronts.upr import UprFrontConfig, serve_upr_front
from gateway.fronts.upr.vblog import VbLog

node_port, state_dir, hold, held, journal_path = sys.argv[1:6]
journal = open(journal_path, "a", buffering=1)
lock = threading.Lock()

def sync(self):  # VbLog.sync, in a worker thread
    if self.file.fd is None or not self.unsynced:
        return
    if os.path.exists(hold):
        open(held, "a").close()
        threading.Event().wait()  # the disk stopped answering: until killed
    path = self.segments[-1].path
    size = os.fstat(self.file.fd).st_size  # at least what this fsync is due to cover
    os.fsync(self.file.fd)
    with lock:
        journal.write(f"{path} {size}\\n")

VbLog.sync = sync

async def main():
    config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", int(node_port)), Path(state_dir),
                            fsync="batch", compact_interval=0, reconnect_min=0.02,
                            reconnect_max=0.2)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_upr_front, config)
        print(port, flush=True)

trio.run(main)
"""


class Gateway:
    """The gateway child process and the files its fsync hook uses."""

    def __init__(self, root: Path) -> None:
        self.state_dir = root / "state"
        self.hold = root / "hold"
        self.held = root / "held"
        self.journal = root / "fsynced"
        self.proc: trio.Process | None = None

    async def start(self, node_port: int) -> int:
        args = [self.state_dir, self.hold, self.held, self.journal]
        self.proc, port = await start_listening(GATEWAY, node_port, *args, what="the gateway")
        return port

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        with trio.fail_after(10):
            await self.proc.wait()

    def power_loss(self) -> None:
        """Cut every segment back to what its last fsync covered (0: never synced)."""
        synced: dict[str, int] = {}
        if self.journal.exists():
            for line in self.journal.read_text().splitlines():
                path, size = line.rsplit(" ", 1)
                synced[path] = max(synced.get(path, 0), int(size))
        for segment in self.state_dir.glob("vb-*/*.seg"):
            os.truncate(segment, min(segment.stat().st_size, synced.get(str(segment), 0)))


def everything_acked(node: Node, store: Store) -> bool:
    registration = node.tap.registration("upr-front")
    return registration is not None and all(
        vb in registration.positions and registration.positions[vb].seqno >= store.high_seqno(vb)
        for vb in range(VBUCKETS)
    )


class Consumer:
    """A UPR consumer streaming every vbucket live, keeping what it was sent."""

    def __init__(self, client: UprClient) -> None:
        self.client = client
        self.logs = {vb: StreamLog() for vb in range(VBUCKETS)}
        self.uuids: dict[int, int] = {}
        self.closed = trio.Event()

    async def stream_all(self) -> None:
        for vb in range(VBUCKETS):
            reply = await self.client.stream_request(vb, 0, MAX_SEQNO, opaque=vb + 1)
            assert isinstance(reply, upr.StreamRequestOk), reply
            self.uuids[vb] = reply.failover_log[0][0]
        for vb in range(VBUCKETS):
            self.client.take_pending(vb + 1, self.logs[vb])

    async def read(self) -> None:
        try:
            while True:
                received = await self.client.receive_sized()
                event = received.event
                await self.client.answer(event)
                opaque = getattr(event, "opaque", 0)
                if not event.IS_RESPONSE and 1 <= opaque <= VBUCKETS:
                    self.logs[opaque - 1].events.append(event)
        except (EOFError, trio.BrokenResourceError):
            pass
        finally:
            self.closed.set()

    def has(self, store: Store) -> bool:
        return all(final_state(self.logs[vb]) == store_state(store, vb) for vb in range(VBUCKETS))

    def position(self, vb: int) -> tuple[int, tuple[int, int]]:
        """(last seqno received, last snapshot marker's range): what it resumes with."""
        log = self.logs[vb]
        marker = log.markers[-1]
        return log.items[-1].by_seqno, (marker.start_seqno, marker.end_seqno)


@pytest.mark.parametrize("power_loss", [True, False], ids=["page-cache-lost", "process-only"])
async def test_sigkill_with_fsyncs_held_rolls_the_consumer_back_and_loses_nothing_acked(
    nursery: trio.Nursery, tmp_path: Path, power_loss: bool
) -> None:
    """``power_loss``: the unsynced bytes are cut off (else the page cache kept them, as
    when only the process dies: then nothing served is lost and no one rolls back)."""
    store = filled_store(20)
    node, node_port = await start_node(nursery, store, checkpoint_interval=0.05)
    gateway = Gateway(tmp_path)
    port = await gateway.start(node_port)
    with trio.fail_after(30):  # the backfill's last ack request is answered (5 ms pacing)
        await until(lambda: everything_acked(node, store))
    consumer = Consumer(await open_producer(port, b"early"))
    await consumer.stream_all()
    nursery.start_soon(consumer.read)
    with trio.fail_after(30):
        await until(lambda: consumer.has(store))

    # The disk stops answering; the node writes on and the consumer is served it.
    gateway.hold.touch()
    for vb in range(VBUCKETS):
        for n in range(5):
            store.set(vb, b"unsynced-%d" % n, b"v%d" % n, now=time.time())
        store.set(vb, b"key-1", b"changed", now=time.time())
        store.delete(vb, b"key-2", now=time.time())
    with trio.fail_after(30):
        await until(lambda: gateway.held.exists() and consumer.has(store))
    seen = {vb: consumer.position(vb) for vb in range(VBUCKETS)}
    registration = node.tap.registration("upr-front")
    assert registration is not None
    acked = dict(registration.positions)
    await gateway.kill()
    with trio.fail_after(10):
        await consumer.closed.wait()
    await consumer.client.aclose()
    if power_loss:
        gateway.power_loss()

    # Every version the node was acked for (and still holds) is in what the disk kept.
    proven: dict[int, int] = {}
    for vb in range(VBUCKETS):
        translator = TapToUpr(vb)
        proof = prove_vbucket(gateway.state_dir / f"vb-{vb:04d}", vb, replay=translator.replay)
        assert proof.proven, proof.problems
        proven[vb] = translator.high_seqno
        for item in store.items_since(vb, 0, acked[vb].seqno):
            assert translator.version(item.key).cas == item.cas, (vb, item)
    # With the page cache lost, the consumer was served items the disk never got.
    lost = [vb for vb in range(VBUCKETS) if seen[vb][0] > proven[vb]]
    assert lost if power_loss else not lost, (seen, proven)

    front, port2, scope = await start_front(nursery, gateway.state_dir, node_port)
    client = await open_producer(port2, b"early")
    rolled_back = 0
    restart: dict[int, int] = {}
    for vb in range(VBUCKETS):
        vblog = front.logs.logs[vb]
        old_uuid = consumer.uuids[vb]
        # The new failover entry starts at the proven end, over the history served.
        assert vblog.failover.entries[0][1] == proven[vb]
        assert vblog.failover.entries[1][0] == old_uuid
        start, snap = seen[vb]
        reply = await client.stream_request(vb, start, MAX_SEQNO, uuid=old_uuid, snap=snap)
        if snap[1] > proven[vb]:
            assert isinstance(reply, upr.StreamRequestRollback), reply
            assert reply.rollback_seqno == min(snap[0], proven[vb])
            restart[vb] = reply.rollback_seqno
            rolled_back += 1
        else:
            assert isinstance(reply, upr.StreamRequestOk), reply
            await client.request(upr.CloseStream(opaque=client.next_opaque(), vbucket=vb))
            restart[vb] = start
    assert rolled_back if power_loss else not rolled_back
    with trio.fail_after(30):
        await until(lambda: caught_up(front, store))
    for vb in range(VBUCKETS):
        vblog = front.logs.logs[vb]
        at = restart[vb]
        kept = [e for e in consumer.logs[vb].items if e.by_seqno <= at]
        reply = await client.stream_request(
            vb, at, vblog.high_seqno, uuid=consumer.uuids[vb], opaque=100 + vb
        )
        assert isinstance(reply, upr.StreamRequestOk), reply
        after = await client.read_stream(100 + vb)
        # Converged: exactly the node's keys, values and deletes.
        assert final_state(StreamLog([*kept, *after.events])) == store_state(store, vb), vb
        # No seqno the consumer saw names another version now.
        highest_seen = seen[vb][0]
        assert all(e.by_seqno > highest_seen for e in after.items if e.by_seqno > proven[vb])
    await client.aclose()
    with trio.fail_after(30):
        await until(lambda: everything_acked(node, store))
    scope.cancel()
