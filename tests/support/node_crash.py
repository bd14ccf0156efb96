"""Kill -9 harness of the reference node's persistence (``node --data-dir``).

The node runs as its own process; a client in this process SETs and DELETEs
over memcached binary and records, in the order they were answered, every
write the node acknowledged with its cas. A UPR consumer (the 3.0 consumer
of ``crash_harness``) follows the node across restarts. After each SIGKILL
the node is started again on the same directory and, before anything else
writes, every vbucket is read whole over UPR (the audit). Checked:

- the journal is one append-only file, so what survives is a prefix of the
  acknowledged writes: for the last acknowledged write found, every key
  holds the version of its last write up to that one (ep-engine 3.0 acks a
  SET before its flusher persists it, so with ``--fsync batch`` or ``never``
  the prefix may stop short; with ``always`` it is every acknowledged write);
- the consumer, after its STREAM_REQ is answered, holds only versions the
  audit has (or a later version of their key); the node's new failover
  entry at its recovered high seqno rolls back one that saw more
  (ep-engine 3.0 src/failover-table.cc ``needsRollback``);
- the data directory is 0700 and its files 0600.
Some restarts are killed again soon after they begin (replaying the journal).
The write in flight at the kill (its answer never came) is left out of both.
"""

from __future__ import annotations

import random
import signal
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import Status
from adapters.mcbp.constants import Opcode
from gateway.io.connection import ConnectionClosed, ConnectionLost, PacketConnection
from tests.support.crash_harness import (
    Consumer,
    Gateway,
    Item,
    LogView,
    event_item,
    private_state,
)
from tests.support.upr_client import UprClient

NODE_LISTENING = r"reference node listening on 127\.0\.0\.1:(\d+)"


@dataclass
class Write:
    vb: int
    key: bytes
    cas: int
    value: bytes | None
    """None: a delete."""


@dataclass
class NodeWriter:
    """Sets and deletes, one at a time, each recorded once the node answered it."""

    vbuckets: int
    rng: random.Random
    keys: int = 200
    acked: list[Write] = field(default_factory=list)
    in_doubt: tuple[int, bytes] | None = None
    """The write sent whose answer never came (the node died first)."""

    async def run(self, port: int) -> None:
        try:
            conn = await PacketConnection.connect("127.0.0.1", port)
        except OSError:
            return
        try:
            while True:
                vb = self.rng.randrange(self.vbuckets)
                key = b"key-%d" % self.rng.randrange(self.keys)
                self.in_doubt = (vb, key)
                if self.rng.random() < 0.15:
                    frame = await conn.request(Opcode.DELETE, key=key, vbucket=vb, check=False)
                    value = None
                else:
                    value = b"%d" % len(self.acked) * self.rng.choice((1, 20, 200))
                    extras = struct.pack(">II", 0, 0)
                    frame = await conn.request(
                        Opcode.SET, key=key, value=value, extras=extras, vbucket=vb, check=False
                    )
                status = frame.vbucket_or_status
                if status == Status.SUCCESS:
                    self.acked.append(Write(vb, key, frame.cas, value))
                else:
                    assert status == Status.KEY_NOT_FOUND, (vb, key, status)  # nothing to delete
                self.in_doubt = None
        except (ConnectionLost, ConnectionClosed, trio.BrokenResourceError, OSError):
            return  # the node died
        finally:
            await conn.aclose()


async def audit(port: int, vbuckets: int, name: bytes) -> LogView:
    """Every vbucket read whole over UPR, as a LogView (seqno -> item, key -> seqno)."""
    async with await PacketConnection.connect("127.0.0.1", port) as admin:
        seqnos = await admin.stats("vbucket-seqno")
    client = await UprClient.connect(port)
    items: dict[int, dict[int, Item]] = {}
    latest: dict[int, dict[bytes, int]] = {}
    high: dict[int, int] = {}
    try:
        assert (await client.open(name)).status == 0
        for vb in range(vbuckets):
            high[vb] = int(seqnos[f"vb_{vb}:high_seqno"])
            items[vb], latest[vb] = {}, {}
            if high[vb] == 0:
                continue
            reply = await client.stream_request(vb, 0, high[vb], opaque=vb + 1)
            assert isinstance(reply, upr.StreamRequestOk), reply
            for event in (await client.read_stream(vb + 1)).items:
                items[vb][event.by_seqno] = event_item(event)
                latest[vb][event.key] = event.by_seqno
    finally:
        await client.aclose()
    return LogView(items, latest, 0, high)


def version(view: LogView, vb: int, key: bytes) -> tuple[int, bytes | None] | None:
    """(cas, value or None when deleted) of ``key``, or None when the node has no trace."""
    seqno = view.latest.get(vb, {}).get(key)
    if seqno is None:
        return None
    _key, value, cas, _rev = view.items[vb][seqno]
    return cas, value


def check_prefix(
    before: LogView, after: LogView, writes: list[Write], in_doubt: tuple[int, bytes] | None
) -> int:
    """How many of ``writes`` (this run's, in the order acked) survived; they must be a
    prefix (see the module docstring)."""
    found = [
        n
        for n, w in enumerate(writes)
        if (w.vb, w.key) != in_doubt and version(after, w.vb, w.key) == (w.cas, w.value)
    ]
    kept = found[-1] + 1 if found else 0
    want: dict[tuple[int, bytes], tuple[int, bytes | None] | None] = {}
    for w in writes:
        want.setdefault((w.vb, w.key), version(before, w.vb, w.key))
    for w in writes[:kept]:
        want[(w.vb, w.key)] = (w.cas, w.value)
    for (vb, key), wanted in want.items():
        if (vb, key) == in_doubt:
            continue
        got = version(after, vb, key)
        assert got == wanted, (
            f"vb {vb} {key!r}: {got} after the restart, but the writes up to the last one "
            f"kept (#{kept} of {len(writes)}) leave {wanted}"
        )
    return kept


@dataclass
class NodeCrashSummary:
    seed: int
    fsync: str
    kills: int = 0
    start_up_kills: int = 0
    """Further kills soon after a restart (while the journal is replayed, or just after)."""
    acked: int = 0
    kept: int = 0
    rollbacks: int = 0
    items_received: int = 0


async def node_crash_run(
    tmp_path: Path,
    seed: int,
    kills: int,
    *,
    fsync: str,
    vbuckets: int = 4,
    kill_after: tuple[float, float] = (0.1, 1.5),
) -> NodeCrashSummary:
    rng = random.Random(seed)
    summary = NodeCrashSummary(seed, fsync)
    data_dir = tmp_path / "data"
    command = [sys.executable, "-m", "gateway", "node", "--listen", "127.0.0.1:0",
               "--vbucket-count", str(vbuckets), "--data-dir", str(data_dir),
               "--fsync", fsync]  # fmt: skip
    writer = NodeWriter(vbuckets, random.Random(rng.random()))
    consumer = Consumer(vbuckets, unique_seqnos=False)
    async with trio.open_nursery() as running:
        node = await Gateway.run(running, command, NODE_LISTENING)
        with trio.fail_after(60):
            await node.listening.wait()
        before = await audit(node.port, vbuckets, b"audit-0")
        for cycle in range(kills):
            writes_from = len(writer.acked)
            async with trio.open_nursery() as load:
                load.start_soon(writer.run, node.port)
                load.start_soon(consumer.session, node.port, before)
                await trio.sleep(rng.uniform(*kill_after))  # the random moment of the kill
                node.kill()
                await node.exited.wait()
                load.cancel_scope.cancel()
            summary.kills += 1
            in_doubt, writer.in_doubt = writer.in_doubt, None
            wrong = private_state(data_dir)
            assert not wrong, f"cycle {cycle}: data not private after SIGKILL: {wrong}"
            if rng.random() < 0.3:  # killed again while it replays its journal
                node = await Gateway.run(running, command, NODE_LISTENING)
                await trio.sleep(rng.uniform(0.0, 0.6))
                node.kill()
                await node.exited.wait()
                summary.start_up_kills += 1
            node = await Gateway.run(running, command, NODE_LISTENING)
            with trio.fail_after(60):
                await node.listening.wait()
            after = await audit(node.port, vbuckets, b"audit-%d" % (cycle + 1))
            writes = writer.acked[writes_from:]
            kept = check_prefix(before, after, writes, in_doubt)
            if fsync == "always":
                lost = len(writes) - kept
                assert lost == 0, f"cycle {cycle}: {lost} writes acked with --fsync always lost"
            summary.kept += kept
            before = after
        node.proc.send_signal(signal.SIGTERM)
        await node.exited.wait()
        assert node.proc.returncode == 0, "\n".join(node.lines[-20:])
        assert not private_state(data_dir)
    summary.acked = len(writer.acked)
    summary.rollbacks = len(consumer.rollbacks)
    summary.items_received = consumer.items_received
    return summary
