"""A consumer that never replies to SET_VBUCKET_STATE(active) stalls only its own vbucket.

ep-engine 3.0 (src/upr-stream.cc, ``ActiveStream::takeoverWaitPhase``) puts no
timer on the takeover wait: the stream sits in takeover-wait until the
consumer's reply (``setVBucketStateAckRecieved``), and only the connection's
NOOP deadline drops a consumer that stopped answering altogether. A consumer
that answers NOOPs but never that reply holds its hand-off for as long as it
lives; meanwhile the gateway's own TAP connection (ep-engine 2.5.1
src/tapconnection.cc: the registered client keeps streaming every vbucket)
brings items for the other vbuckets, and for the one being handed over
(duplicates, lagging behind the takeover connection). Those must be served,
synced and acked as usual; on the vbucket handed over nothing is served
before its fsync until the consumer replied.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import trio

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.mcbp.constants import VBucketState
from adapters.tap import TapFlags, TapMutation, encode
from gateway.fronts.upr.takeover import HANDED_OVER
from gateway.fronts.upr.vblog import VbLog
from tests.gateway.fronts.upr.support import UprClient, until
from tests.support.tap_node import HeldSyncs, ask_state, read_frame, start_front_with_node

VBUCKETS = (0, 1, 2)
STUCK = 1
"""The vbucket whose takeover consumer never replies to ACTIVE (one in the middle:
a committer that takes the logs' locks in vbucket order holds vbucket 0's meanwhile)."""
OTHERS = (0, 2)
NOOP_INTERVAL = 2
"""Seconds: the takeover consumer answers NOOPs until it goes silent."""
FIRST = 3
"""Items of each vbucket before the takeover."""


def _item(vb: int, i: int, opaque: int = 0) -> bytes:
    """Item ``i`` of ``vb`` (the same bytes each time: sent again, it is a duplicate)."""
    flags = TapFlags.ACK if opaque else TapFlags(0)
    return encode(
        TapMutation(
            b"key-%d-%d" % (vb, i),
            b"value-%d" % i,
            vbucket=vb,
            cas=i + 1,
            rev_seqno=1,
            opaque=opaque,
            tap_flags=flags,
        )
    )


class TapNode:
    """The gateway's own connection streams every vbucket and sends what it is given;
    the takeover connection hands ``STUCK`` over at once and waits for the acks."""

    def __init__(self) -> None:
        self.send, self._to_send = trio.open_memory_channel[bytes](10)
        self.acked: set[int] = set()
        """Opaques of the own connection's messages the gateway acked."""
        self.active_acked = trio.Event()
        self.active_unacked = trio.Event()
        """The gateway closed the takeover connection without acking VBUCKET_SET(active)."""

    async def own(self, stream: trio.SocketStream, reader: FrameReader) -> None:
        await stream.send_all(b"".join(_item(vb, i) for vb in VBUCKETS for i in range(FIRST)))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._acks, stream, reader)
            async for data in self._to_send:
                await stream.send_all(data)

    async def takeover(self, stream: trio.SocketStream, reader: FrameReader) -> None:
        assert await ask_state(stream, reader, STUCK, VBucketState.PENDING, 1) is not None
        if await ask_state(stream, reader, STUCK, VBucketState.ACTIVE, 2) is not None:
            self.active_acked.set()
        else:
            self.active_unacked.set()
        await stream.aclose()

    async def _acks(self, stream: trio.SocketStream, reader: FrameReader) -> None:
        while True:
            frame = await read_frame(stream, reader)
            if not frame.is_request:
                self.acked.add(frame.opaque)


class Taker:
    """The takeover consumer: answers NOOPs, markers and PENDING, ACTIVE only once told
    (``answer_active``); once ``silent``, it reads and answers nothing more."""

    def __init__(self, client: UprClient) -> None:
        self.client = client
        self.events: list[upr.UprEvent] = []
        self.active: upr.SetVbucketState | None = None
        self.told_active = trio.Event()
        self.ended = trio.Event()
        self.silent = False

    async def run(self) -> None:
        try:
            await self._run()
        except (EOFError, trio.ClosedResourceError, trio.BrokenResourceError):
            return  # dropped

    async def _run(self) -> None:
        while True:
            event = await self.client.receive()
            if self.silent:
                return
            if event.IS_RESPONSE:
                continue
            if not isinstance(event, upr.Noop):
                self.events.append(event)
            if isinstance(event, upr.SetVbucketState) and event.state is VBucketState.ACTIVE:
                self.active = event
                self.told_active.set()
                continue
            await self.client.answer(event)
            if isinstance(event, upr.StreamEnd):
                self.ended.set()
                return

    async def answer_active(self) -> None:
        assert self.active is not None
        await self.client.answer(self.active)

    def after_active(self) -> list[upr.UprEvent]:
        """What the stream sent after SET_VBUCKET_STATE(active)."""
        for n, event in enumerate(self.events):
            if isinstance(event, upr.SetVbucketState) and event.state is VBucketState.ACTIVE:
                return self.events[n + 1 :]
        raise AssertionError("not told active")


class Watcher:
    """A plain consumer of other vbuckets: the items it was served, per vbucket."""

    def __init__(self, client: UprClient) -> None:
        self.client = client
        self.items: defaultdict[int, list[int]] = defaultdict(list)

    async def run(self) -> None:
        try:
            await self._run()
        except (EOFError, trio.ClosedResourceError, trio.BrokenResourceError):
            return  # the test dropped the connection

    async def _run(self) -> None:
        while True:
            event = await self.client.receive()
            await self.client.answer(event)
            if isinstance(event, upr.Mutation):
                self.items[event.vbucket].append(event.by_seqno)


async def _start(
    nursery: trio.Nursery,
    tmp_path: Path,
    fsync: str,
    watched: tuple[int, ...],
    clients: list[UprClient],
) -> tuple[TapNode, dict[int, VbLog], Taker, Watcher]:
    """The node, the gateway, the takeover consumer told ACTIVE (not replying) and a
    consumer streaming ``watched``, once it was served every item sent so far (their
    connections added to ``clients``, for the caller to close)."""
    node = TapNode()
    front, port = await start_front_with_node(
        nursery, tmp_path, node.own, node.takeover, vbuckets=VBUCKETS, fsync=fsync
    )
    logs = {vb: front.logs.logs[vb] for vb in VBUCKETS}
    await until(lambda: all(v.high_seqno == FIRST and not v.unsynced for v in logs.values()))

    taker = Taker(await UprClient.connect(port))
    clients.append(taker.client)
    assert (await taker.client.open(b"taker")).status == 0
    # A live consumer: the gateway drops it if a NOOP goes unanswered for an interval.
    assert (await taker.client.control("enable_noop", "true")).status == 0
    assert (await taker.client.control("set_noop_interval", str(NOOP_INTERVAL))).status == 0
    opened = await taker.client.stream_request(STUCK, flags=upr.StreamFlags.TAKEOVER)
    assert opened.status == 0
    nursery.start_soon(taker.run)
    watcher = Watcher(await UprClient.connect(port))
    clients.append(watcher.client)
    assert (await watcher.client.open(b"watcher")).status == 0
    for vb in watched:
        assert (await watcher.client.stream_request(vb)).status == 0
    nursery.start_soon(watcher.run)
    await taker.told_active.wait()
    await until(lambda: all(len(watcher.items[vb]) == FIRST for vb in watched))
    return node, logs, taker, watcher


@pytest.mark.parametrize("fsync", ["batch", "always"])
async def test_other_vbuckets_are_served_synced_and_acked_while_active_is_unanswered(
    nursery: trio.Nursery, tmp_path: Path, fsync: str
) -> None:
    clients: list[UprClient] = []
    try:
        with trio.fail_after(30):
            node, logs, taker, watcher = await _start(nursery, tmp_path, fsync, OTHERS, clients)
            # One read: a duplicate of the vbucket handed over (its log is touched), and
            # new items of the others; then the others alone.
            await node.send.send(
                _item(STUCK, 0, 0x101) + _item(0, FIRST, 0x102) + _item(2, FIRST, 0x103)
            )
            await until(lambda: {0x101, 0x102, 0x103} <= node.acked)
            await node.send.send(_item(0, FIRST + 1, 0x104) + _item(2, FIRST + 1, 0x105))
            await until(lambda: {0x104, 0x105} <= node.acked)
            await until(lambda: all(len(watcher.items[vb]) == FIRST + 2 for vb in OTHERS))
            for vb in OTHERS:
                assert watcher.items[vb] == list(range(1, FIRST + 3))
                assert logs[vb].high_seqno == FIRST + 2
                assert not logs[vb].unsynced and not logs[vb].sync_in_doubt
            assert logs[STUCK].high_seqno == FIRST  # the duplicate kept its seqno
            # The stuck consumer was told nothing more, nor was the node's hand-off acked.
            assert taker.after_active() == []
            assert not node.active_acked.is_set()
            assert logs[STUCK].handing_over

            await taker.answer_active()
            await node.active_acked.wait()
            await taker.ended.wait()
    finally:
        for client in clients:
            await client.aclose()
    end = taker.events[-1]
    assert isinstance(end, upr.StreamEnd) and end.reason == upr.StreamEndReason.OK
    assert not logs[STUCK].handing_over
    assert (logs[STUCK].dir / HANDED_OVER).exists()


async def test_the_vbucket_handed_over_is_served_only_once_synced_until_the_reply(
    nursery: trio.Nursery,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With fsync batch the ingest serves records before their fsync, except on the
    vbucket being handed over: between the check and the consumer's reply, a record of
    it is served only once synced. The consumer then goes silent: the NOOP deadline
    drops it, the hand-off ends, the TAP node's VBUCKET_SET(active) is never acked,
    and the vbucket stays recorded as handed over (told active, it may be active
    there)."""
    held = HeldSyncs(monkeypatch, STUCK)
    clients: list[UprClient] = []
    try:
        with trio.fail_after(30):
            node, logs, taker, watcher = await _start(
                nursery, tmp_path, "batch", (0, STUCK), clients
            )
            held.hold.set()
            await node.send.send(_item(STUCK, FIRST, 0x201) + _item(0, FIRST, 0x202))
            await until(lambda: held.waiting == 1 and len(watcher.items[0]) == FIRST + 1)
            assert logs[STUCK].high_seqno == FIRST  # written, not served before its fsync
            assert len(watcher.items[STUCK]) == FIRST
            assert not {0x201, 0x202} & node.acked
            held.release.set()
            await until(lambda: {0x201, 0x202} <= node.acked)
            await until(lambda: len(watcher.items[STUCK]) == FIRST + 1)
            assert logs[STUCK].high_seqno == FIRST + 1
            assert not logs[STUCK].unsynced
            assert taker.after_active() == []
            assert logs[STUCK].handing_over

            # It goes silent: the connection's NOOP deadline drops it (ep-engine 3.0 has
            # no other bound on the takeover wait), which ends the hand-off.
            taker.silent = True
            await node.active_unacked.wait()
            await until(lambda: not logs[STUCK].handing_over)
            await until(lambda: any("did not answer a NOOP" in m for m in caplog.messages))
    finally:
        held.release.set()
        for client in clients:
            await client.aclose()
    assert (logs[STUCK].dir / HANDED_OVER).exists()
    dropped = [m for m in caplog.messages if "did not answer a NOOP" in m]
    assert len(dropped) == 1 and "'taker'" in dropped[0], dropped
