"""The TAP front when its upstream UPR node is SIGKILLed mid-backfill and restarted.

The node runs as a child process on a data directory; it is killed while the
TAP client is still being backfilled and keeps acking what it received, so
acks reach the front while its upstream is down. The client must keep its
connection and end with every key exactly once, for every combination of
support-ack, checkpoint and registered client.
"""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path

import pytest
import trio

from adapters.mcbp import Frame
from adapters.tap import ConnectFlags, OpaqueCode, TapEvent, TapMutation, decode_frame
from gateway.node.store import Store
from tests.support.children import start_listening
from tests.support.classic_tap import asks_for_ack, classic_connect, classic_reply
from tests.support.tap_client import TapClient, is_opaque, until
from tests.support.tapfront import check_brackets, start_front

F = ConnectFlags
VBUCKETS = 4
NODE = """
import sys, trio
from pathlib import Path
from gateway.node.main import NodeOptions, run_node

async def main():
    options = NodeOptions(port=int(sys.argv[1]), vbuckets=4, data_dir=Path(sys.argv[2]))
    async with trio.open_nursery() as nursery:
        print(await nursery.start(run_node, options), flush=True)

trio.run(main)
"""


async def start_node_process(port: int, data_dir: Path) -> tuple[trio.Process, int]:
    return await start_listening(NODE, port, data_dir, what="the node process")


def write_items(data_dir: Path, count: int, value_size: int) -> set[bytes]:
    store = Store(VBUCKETS, data_dir=data_dir)
    now = time.time()
    keys = set()
    for i in range(count):
        key = b"item-%06d" % i
        store.set(i % VBUCKETS, key, b"v" * value_size, now=now)
        keys.add(key)
    store.close()
    return keys


class Client:
    """A classic 2.x TAP client that reads and acks (when asked) until closed,
    holding still (no reads, no acks) from ``pause_at`` mutations until resumed."""

    def __init__(self, tap: TapClient, pause_at: int) -> None:
        self.tap = tap
        self.pause_at = pause_at
        self.paused = trio.Event()
        self.resume = trio.Event()
        self.events: list[TapEvent] = []
        self.mutations = 0
        self.done = trio.Event()

    async def run(self, total: int) -> None:
        frame: Frame | None
        while (frame := await self.tap.next_frame()) is not None:
            event = decode_frame(frame)
            self.events.append(event)
            self.mutations += isinstance(event, TapMutation)
            if self.mutations == self.pause_at and not self.paused.is_set():
                self.paused.set()
                await self.resume.wait()
            if asks_for_ack(frame):
                await self.tap.send(classic_reply(frame))
            if self.mutations >= total:
                self.done.set()


async def kill_and_restart(
    nursery: trio.Nursery, tmp_path: Path, flags: ConnectFlags, count: int, value_size: int
) -> None:
    data_dir = tmp_path / "node"
    keys = write_items(data_dir, count, value_size)
    proc, node_port = await start_node_process(0, data_dir)
    # The ack window (64 messages of 1 KB) fills long before the upstream
    # buffer (1 MiB): with support-ack, a client that holds still leaves the
    # front waiting on it, not reading the upstream, when the node dies; the
    # acks that follow reach a front whose upstream is gone and that has not
    # noticed yet. Either way the node is mid-backfill.
    front, port = await start_front(
        nursery,
        node_port,
        state_dir=tmp_path / "front",
        buffer_size=1024 * 1024,
        max_unacked=64,
        ack_interval=16,
    )
    opts: dict[int, object] = {F.BACKFILL: 0}
    opts.update({flag: b"" for flag in F if flag & flags})
    tap = await TapClient.open(port)
    await tap.send(classic_connect(b"killed-upstream", opts))
    client = Client(tap, pause_at=count // 10)
    try:
        async with trio.open_nursery() as reading:
            reading.start_soon(client.run, count)
            await client.paused.wait()
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            # The client acks on (with support-ack) into a front whose upstream
            # is gone; the front finds out and retries.
            client.resume.set()
            await until(lambda: sum(front.stats.upstream_reconnects_total.values()) >= 1)
            session = front.sessions.get("killed-upstream")
            assert session is not None, "the TAP client lost its connection"
            assert any(vb.translator.backfill_pending for vb in session.vbuckets.values())
            proc, _ = await start_node_process(node_port, data_dir)
            await client.done.wait()
            assert front.sessions.get("killed-upstream") is session
            reading.cancel_scope.cancel()
    finally:
        proc.kill()
        await proc.wait()
        await tap.aclose()
    got = [e.key for e in client.events if isinstance(e, TapMutation)]
    assert len(got) == count and set(got) == keys  # no gap, no duplicate
    resets = [e.vbucket for e in client.events if is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM)]
    assert sorted(resets) == list(range(VBUCKETS))  # no vbucket was started over
    check_brackets(client.events)


COMBINATIONS = [
    F(sum(chosen))
    for chosen in itertools.product((0, F.SUPPORT_ACK), (0, F.CHECKPOINT), (0, F.REGISTERED_CLIENT))
]


@pytest.mark.parametrize("flags", COMBINATIONS, ids=lambda f: str(int(f)))
async def test_upstream_killed_mid_backfill_and_restarted(
    nursery: trio.Nursery, tmp_path: Path, flags: ConnectFlags
) -> None:
    # Without acks only the socket buffers hold the front back: make the
    # backfill outgrow them (4 MiB outbox plus the kernel's) several times.
    value_size = 1000 if flags & F.SUPPORT_ACK else 5000
    with trio.fail_after(60):
        await kill_and_restart(nursery, tmp_path, flags, 3000, value_size)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags", [F(0), F.SUPPORT_ACK | F.CHECKPOINT | F.REGISTERED_CLIENT], ids=["none", "all"]
)
async def test_upstream_killed_mid_backfill_of_30000_items(
    nursery: trio.Nursery, tmp_path: Path, flags: ConnectFlags
) -> None:
    with trio.fail_after(300):
        await kill_and_restart(nursery, tmp_path, flags, 30_000, 1000)
