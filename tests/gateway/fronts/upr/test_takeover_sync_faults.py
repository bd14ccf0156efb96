"""A takeover tells the consumer ACTIVE only once every record served on the vbucket is synced.

With fsync batch the ingest serves records before their fsync. ep-engine 3.0
(src/upr-stream.cc, ``ActiveStream::setVBucketStateAckRecieved``) hands the
vbucket over once the consumer took everything before SET_VBUCKET_STATE(active);
the gateway relays the TAP node's hand-off (ep-engine 2.5.1 src/tapconnection.cc:
VBUCKET_SET(pending), the stream, the vbucket dead, VBUCKET_SET(active)), and
a crash after the hand-off must not leave its log behind what the new active
node was sent. Here a scripted TAP node sends items on the gateway's own
connection while the gateway's fsyncs are held, between the two VBUCKET_SETs
of the takeover connection (which itself carries no item, so it commits
nothing of them): the active state must wait for those fsyncs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import trio

from adapters import upr
from adapters.mcbp import FrameReader, Status
from adapters.mcbp.constants import VBucketState
from adapters.tap import TapMutation, encode
from gateway.fronts.upr.server import UprFront
from gateway.fronts.upr.takeover import HANDED_OVER
from tests.gateway.fronts.upr.support import StreamLog, UprClient, until
from tests.support.tap_node import HeldSyncs, ask_state, start_front_with_node

VB = 0


def _mutations(first: int, n: int) -> bytes:
    return b"".join(
        encode(TapMutation(b"key-%d" % i, b"value-%d" % i, vbucket=VB, cas=i + 1, rev_seqno=1))
        for i in range(first, first + n)
    )


class TapNode:
    """The gateway's own connection gets items when asked; a takeover connection hands
    the vbucket over, asking for ACTIVE only once told to."""

    def __init__(self) -> None:
        self.send_more = trio.Event()
        self.pending_acked = trio.Event()
        self.ask_active = trio.Event()
        self.active_acked = trio.Event()
        self.active_unacked = trio.Event()
        """The gateway closed the takeover connection without acking VBUCKET_SET(active)."""

    async def own(self, stream: trio.SocketStream, reader: FrameReader) -> None:
        await stream.send_all(_mutations(0, 10))
        await self.send_more.wait()
        await stream.send_all(_mutations(10, 5))
        await trio.sleep_forever()

    async def takeover(self, stream: trio.SocketStream, reader: FrameReader) -> None:
        assert await ask_state(stream, reader, VB, VBucketState.PENDING, 1) is not None
        self.pending_acked.set()
        await self.ask_active.wait()
        if await ask_state(stream, reader, VB, VBucketState.ACTIVE, 2) is not None:
            self.active_acked.set()
        else:
            self.active_unacked.set()
        await stream.aclose()

    async def start(self, nursery: trio.Nursery, tmp_path: Path) -> tuple[UprFront, int]:
        """The front, fsync batch, once its log of ``VB`` holds the first 10 items, synced."""
        front, port = await start_front_with_node(
            nursery, tmp_path, self.own, self.takeover, vbuckets=(VB,), fsync="batch"
        )
        vblog = front.logs.logs[VB]
        with trio.fail_after(10):
            await until(lambda: vblog.high_seqno == 10 and not vblog.unsynced)
        return front, port


async def test_active_waits_for_the_fsync_of_records_served_early(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldSyncs(monkeypatch)
    node = TapNode()
    front, port = await node.start(nursery, tmp_path)
    vblog = front.logs.logs[VB]

    client = await UprClient.connect(port)
    states: list[upr.VBucketState] = []
    ended: list[upr.StreamEnd] = []

    async def consume() -> None:
        while True:
            event = (await client.receive_sized()).event
            await client.answer(event)
            if isinstance(event, upr.SetVbucketState):
                states.append(event.state)
            elif isinstance(event, upr.StreamEnd):
                ended.append(event)
                return

    try:
        with trio.fail_after(20):
            assert (await client.open(b"taker")).status == 0
            opened = await client.stream_request(VB, flags=upr.StreamFlags.TAKEOVER)
            assert opened.status == 0
            nursery.start_soon(consume)
            await node.pending_acked.wait()
            assert states == [upr.VBucketState.PENDING]

            # The disk stops answering; the node's last items are served before their fsync.
            held.hold.set()
            node.send_more.set()
            await until(lambda: vblog.high_seqno == 15 and held.waiting == 1)
            assert vblog.unsynced
            node.ask_active.set()
            # The hand-off fsyncs the log itself (and waits there) before ACTIVE goes out.
            await until(lambda: held.waiting == 2 or len(states) > 1)
            assert states == [upr.VBucketState.PENDING]
            assert not node.active_acked.is_set()
            assert not (vblog.dir / HANDED_OVER).exists()

            held.release.set()
            await node.active_acked.wait()
            await until(lambda: bool(ended))
    finally:
        held.release.set()
        await client.aclose()
    assert states == [upr.VBucketState.PENDING, upr.VBucketState.ACTIVE]
    assert ended[0].reason == upr.StreamEndReason.OK
    assert not vblog.unsynced and not vblog.sync_in_doubt
    assert vblog.high_seqno == 15
    record = vblog.dir / HANDED_OVER
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
    assert not front.serves(VB)

    again = await UprClient.connect(port)
    try:
        with trio.fail_after(10):
            assert (await again.open(b"late")).status == 0
            refused = await again.stream_request(VB)
    finally:
        await again.aclose()
    assert refused.status == Status.NOT_MY_VBUCKET


async def test_a_hand_off_whose_records_cannot_be_synced_fails_before_active(
    nursery: trio.Nursery,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every fsync fails from the node's last items on: the consumer is never told
    active, the stream ends STATE_CHANGED, the TAP node's VBUCKET_SET(active) is never
    acked and the vbucket is not recorded as handed over."""
    held = HeldSyncs(monkeypatch)
    node = TapNode()
    front, port = await node.start(nursery, tmp_path)
    vblog = front.logs.logs[VB]
    client = await UprClient.connect(port)
    logs: list[StreamLog] = []
    try:
        with trio.fail_after(20):
            assert (await client.open(b"taker")).status == 0
            opened = await client.stream_request(VB, flags=upr.StreamFlags.TAKEOVER)
            assert opened.status == 0

            async def read() -> None:
                logs.append(await client.read_stream(opened.opaque))

            nursery.start_soon(read)
            await node.pending_acked.wait()
            held.fail.set()
            node.send_more.set()
            await until(lambda: vblog.high_seqno == 15)
            node.ask_active.set()
            await node.active_unacked.wait()
            await until(lambda: bool(logs))
    finally:
        await client.aclose()
    log = logs[0]
    assert log.states() == [upr.VBucketState.PENDING]
    assert log.end is not None and log.end.reason == upr.StreamEndReason.STATE_CHANGED
    assert not (vblog.dir / HANDED_OVER).exists()
    assert VB not in front.taken_over
    failed = [
        r.getMessage()
        for r in caplog.records
        if "takeover from the TAP node failed" in r.getMessage()
    ]
    assert len(failed) == 1 and "could not be made durable" in failed[0], failed
