"""A vbucket handed over stays dead here across a SIGKILL and a restart.

ep-engine 3.0 makes the producer's vbucket dead on the consumer's reply to
SET_VBUCKET_STATE(pending) (src/upr-stream.cc,
``ActiveStream::setVBucketStateAckRecieved``), persists that state and warms
it up dead; a stream request for a vbucket it does not hold gets
NOT_MY_VBUCKET (src/upr-producer.cc, ``UprProducer::streamRequest``). The
gateway records the hand-off in ``vb-NNNN/handed-over`` before the consumer
is told active: after a kill and a restart the vbucket is neither ingested
(left out of the TAP CONNECT even when configured) nor served, start-up says
so in one line, and the other vbuckets carry on.
"""

from __future__ import annotations

import io
import logging
import signal
import stat
import time
from pathlib import Path

import pytest
import trio

from adapters import upr
from adapters.mcbp import Status
from gateway.fronts.upr.checklog import check_state_dir
from gateway.fronts.upr.ingest import Ingest
from gateway.fronts.upr.stat_groups import collect
from gateway.fronts.upr.takeover import HANDED_OVER
from gateway.fronts.upr.vblog import VbLog
from gateway.node.items import VBucketState
from gateway.node.server import Node
from gateway.node.store import Store
from tests.gateway.fronts.upr.support import (
    VBUCKETS,
    filled_store,
    final_state,
    open_producer,
    start_front,
    start_node,
    store_state,
    until,
)
from tests.support.children import start_listening

TAKEN = 1
OTHERS = [vb for vb in range(VBUCKETS) if vb != TAKEN]

GATEWAY = """
import sys, trio
from pathlib import Path
from gateway.fronts.upr import UprFrontConfig, serve_upr_front

node_port, state_dir = sys.argv[1:3]

async def main():
    config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", int(node_port)), Path(state_dir),
                            fsync="batch", compact_interval=0, reconnect_min=0.02,
                            reconnect_max=0.2)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_upr_front, config)
        print(port, flush=True)

trio.run(main)
"""


async def start_child(node_port: int, state_dir: Path) -> tuple[trio.Process, int]:
    return await start_listening(GATEWAY, node_port, state_dir, what="the gateway")


def acked(node: Node, store: Store, vbuckets: list[int]) -> bool:
    registration = node.tap.registration("upr-front")
    return registration is not None and all(
        vb in registration.positions and registration.positions[vb].seqno >= store.high_seqno(vb)
        for vb in vbuckets
    )


def holds(vblog: VbLog | None, store: Store, vb: int) -> bool:
    """The log's index holds the node's versions of ``vb``."""
    if vblog is None or vblog.high_seqno != vblog.translator.high_seqno:
        return False
    t = vblog.translator
    index = {k: v for k in t.index if (v := t.version(k)) is not None}
    want = store_state(store, vb)
    return {k: v.cas for k, v in index.items()} == {k: cas for k, (cas, _) in want.items()}


async def test_a_vbucket_handed_over_is_not_served_or_ingested_after_a_kill(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = filled_store(20)
    node, node_port = await start_node(nursery, store, checkpoint_interval=0.05)
    state_dir = tmp_path / "state"
    proc, port = await start_child(node_port, state_dir)
    try:
        with trio.fail_after(30):
            await until(lambda: acked(node, store, list(range(VBUCKETS))))
        client = await open_producer(port, b"taker")
        try:
            reply = await client.stream_request(TAKEN, flags=upr.StreamFlags.TAKEOVER, opaque=5)
            assert isinstance(reply, upr.StreamRequestOk), reply
            with trio.fail_after(30):
                taken = await client.read_stream(5)
        finally:
            await client.aclose()
        assert taken.states() == [upr.VBucketState.PENDING, upr.VBucketState.ACTIVE]
        assert taken.end is not None and taken.end.reason == upr.StreamEndReason.OK
        assert final_state(taken) == store_state(store, TAKEN)
        assert store.state(TAKEN) is VBucketState.DEAD
    finally:
        proc.send_signal(signal.SIGKILL)
        with trio.fail_after(10):
            await proc.wait()
    record = state_dir / f"vb-{TAKEN:04d}" / HANDED_OVER
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    report = io.StringIO()
    assert check_state_dir(state_dir, report) == 0
    said = [line for line in report.getvalue().splitlines() if "handed over" in line]
    assert len(said) == 1 and said[0].startswith(f"vb {TAKEN}: proven"), report.getvalue()

    connected: list[list[int]] = []
    real_event = Ingest.connect_event

    def connect_event(ingest: Ingest, logs: list[VbLog]) -> object:
        connected.append([v.vbucket for v in logs])
        return real_event(ingest, logs)

    caplog.set_level(logging.INFO)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Ingest, "connect_event", connect_event)
        # Configured with every vbucket: the one handed over is still left out.
        front, port2, scope = await start_front(
            nursery, state_dir, node_port, vbuckets=tuple(range(VBUCKETS))
        )
    lines = [r for r in caplog.records if "handed over" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert str(TAKEN) in lines[0].getMessage() and HANDED_OVER in lines[0].getMessage()
    assert connected == [OTHERS]
    assert not front.serves(TAKEN)
    assert (f"vb_{TAKEN}", "dead") in collect(front, "vbucket")
    # Its log is still there as it was handed over, and holds what the consumer got.
    assert holds(front.logs.get(TAKEN), store, TAKEN)

    now = time.time()
    for vb in OTHERS:
        store.set(vb, b"after-restart", b"v%d" % vb, now=now)
    with trio.fail_after(30):
        await until(lambda: all(holds(front.logs.get(vb), store, vb) for vb in OTHERS))
    client = await open_producer(port2, b"after")
    try:
        with trio.fail_after(20):
            refused = await client.stream_request(TAKEN, opaque=9)
            assert refused.status == Status.NOT_MY_VBUCKET, refused
            for vb in OTHERS:
                high = front.logs.logs[vb].high_seqno
                reply = await client.stream_request(vb, 0, high, opaque=20 + vb)
                assert isinstance(reply, upr.StreamRequestOk), reply
                got = await client.read_stream(20 + vb)
                assert final_state(got) == store_state(store, vb), vb
    finally:
        await client.aclose()
    scope.cancel()
