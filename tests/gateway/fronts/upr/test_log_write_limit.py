"""A log write cut short by the file system: the log stays whole and nothing of it is acked.

The gateway runs in a child process under ``RLIMIT_FSIZE`` (the kernel
writes up to the limit, then fails with EFBIG; Python ignores SIGXFSZ), fed
by a reference node in this process. Once a segment reaches the limit
mid-batch, the log must be cut back to its last whole record, the TAP
messages of the batch must stay unacknowledged (the node resends them),
and consumers must only ever see whole, acknowledged-or-later history. When
the limit is lifted (SIGUSR1 in the child) the ingest writes the same
records again and catches up; a SIGKILL and a restart then find every log
proven.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

from adapters import upr
from gateway.fronts.upr.proof import prove_vbucket
from gateway.io.connection import PacketConnection
from gateway.node.store import Store
from tests.gateway.fronts.upr.log_damage import Consumer, start
from tests.gateway.fronts.upr.support import (
    MAX_SEQNO,
    VBUCKETS,
    open_producer,
    start_node,
    store_state,
    until,
)

LIMIT = 48 * 1024
"""Bytes a file may grow to in the child: a few dozen items per segment."""
VALUE = b"v" * 1000

GATEWAY = """
import logging, resource, signal, sys, trio
from pathlib import Path
from gateway.fronts.upr import UprFrontConfig, serve_upr_front

_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), hard))
signal.signal(signal.SIGUSR1, lambda *_: resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard)))
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")

async def main():
    config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", int(sys.argv[1])), Path(sys.argv[2]),
                            compact_interval=0, reconnect_min=0.02, reconnect_max=0.2)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_upr_front, config)
        print(port, flush=True)

trio.run(main)
"""


async def _highs(port: int) -> dict[int, int]:
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        stats = await client.stats("vbucket-seqno")
    return {vb: int(stats[f"vb_{vb}:high_seqno"]) for vb in range(VBUCKETS)}


async def _read_all(consumer: Consumer, port: int) -> None:
    """Every vbucket from 0 to the gateway's high seqno, recorded by (uuid, seqno)."""
    highs = await _highs(port)
    client = await open_producer(port, b"reader")
    for vb in range(VBUCKETS):
        reply = await client.stream_request(vb, 0, highs[vb], opaque=vb + 1)
        assert isinstance(reply, upr.StreamRequestOk), reply
        log = await client.read_stream(vb + 1)
        assert log.end is not None and log.end.reason == upr.StreamEndReason.OK, log.end
        assert [e.by_seqno for e in log.items] == sorted({e.by_seqno for e in log.items})
        consumer.note(vb, reply.failover_log[0][0], log)
        consumer.logs[vb] = log
        consumer.positions[vb] = (reply.failover_log[0][0], highs[vb])
    await client.aclose()


async def test_a_write_cut_short_by_a_file_size_limit_is_neither_kept_nor_acked(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS)
    for i in range(40):
        store.set(i % VBUCKETS, b"first-%d" % i, VALUE, now=time.time())
    node, node_port = await start_node(nursery, store)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", GATEWAY, str(node_port), str(tmp_path), str(LIMIT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    errors = bytearray()

    async def collect(stream: trio.abc.ReceiveStream) -> None:
        while data := await stream.receive_some(4096):
            errors.extend(data)

    nursery.start_soon(collect, proc.stderr)
    with trio.fail_after(20):
        line = b""
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive_some(100)
    port = int(line)

    def acked() -> bool:
        registration = node.tap.registration("upr-front")
        return registration is not None and all(
            vb in registration.positions
            and registration.positions[vb].seqno >= store.high_seqno(vb)
            for vb in range(VBUCKETS)
        )

    with trio.fail_after(20):
        await until(acked)
    # Live writes until a segment reaches the limit part-way through a batch.
    with trio.fail_after(30):
        i = 0
        while b"cannot append" not in errors:
            store.set(i % VBUCKETS, b"live-%d" % (i % 400), VALUE + b"%d" % i, now=time.time())
            i += 1
            await trio.sleep(0.001 if i % 8 == 0 else 0)
    assert b"File too large" in errors and b"nothing acknowledged" in errors, errors[-400:]
    # Room was left when it failed: the kernel wrote part of the batch before refusing.
    kept = re.search(rb"last whole record \((\d+) bytes\)", errors)
    assert kept is not None and int(kept.group(1)) < LIMIT, errors[-400:]

    # On disk: every log whole (no torn record left by the failed write).
    for vb in range(VBUCKETS):
        proof = prove_vbucket(tmp_path / f"vb-{vb:04d}", vb)
        assert proof.proven and not proof.torn, (vb, proof.problems, proof.torn)
        assert all(s.size <= LIMIT for s in proof.segments)
    # What the node counts as delivered is in the log, and served whole.
    registration = node.tap.registration("upr-front")
    assert registration is not None
    delivered = {vb: p.seqno for vb, p in registration.positions.items()}
    assert any(delivered[vb] < store.high_seqno(vb) for vb in range(VBUCKETS))  # held back
    consumer = Consumer()
    await _read_all(consumer, port)
    for vb in range(VBUCKETS):
        held = consumer.state(vb)
        for item in store.items_since(vb, 0, delivered[vb]):
            assert held[item.key][0] == item.cas, (vb, item.key)

    proc.send_signal(signal.SIGUSR1)  # room again: the same records are written
    with trio.fail_after(30):
        await until(acked)
    assert b"Traceback" not in errors, errors.decode(errors="replace")
    await _read_all(consumer, port)
    for vb in range(VBUCKETS):
        assert consumer.state(vb) == store_state(store, vb), vb
    proc.send_signal(signal.SIGKILL)
    await proc.wait()

    gateway = await start(nursery, tmp_path, node_port)
    for vb in range(VBUCKETS):
        vblog = gateway.front.logs.logs[vb]
        # Killed, not closed: a new failover entry at the proven end of each log.
        assert vblog.problems == [] and not vblog.continued, (vb, vblog.problems)
    client = await open_producer(gateway.port, b"resumer")
    for vb in range(VBUCKETS):
        uuid, high = consumer.positions[vb]
        reply = await client.stream_request(vb, high, MAX_SEQNO, uuid=uuid, opaque=vb + 1)
        assert isinstance(reply, upr.StreamRequestOk), (vb, reply)  # all it holds was synced
    await client.aclose()
    await gateway.stop()
