"""CPU of the UPR front's live serving alone: one consumer, in-memory logs, no ingest.

    PYTHONPATH=. python bench/upr_serve_bench.py [--rounds 2000] [--touched 40]
        [--vbuckets 64] [--window 0]

Each round publishes one item (one TAP checkpoint: its own snapshot) to
``--touched`` of the vbuckets, as one ingest read does at 20k items/s, and
waits until the consumer (a socket pair, read in the same process) has every
message of it, so the streams always keep up; prints the process's CPU per
item served (the consumer's reads included, the same for any version of the
serving code) and the sends the connection made.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from adapters import upr
from adapters.translate.log_records import ItemKind, LogItem
from adapters.upr.dialect import DCP
from gateway.fronts.upr.producer import UprConnection
from gateway.fronts.upr.segments import buffer_items, close_block
from gateway.fronts.upr.streams import LogStream
from gateway.io.connection import PacketConnection

try:  # the tail as record bytes (read_memory); older code reads LogItems (read)
    from gateway.fronts.upr.log_tail import LogTail
except ImportError:
    LogTail = None  # type: ignore[assignment,misc]
from gateway.metrics.figures import StreamStats


class MemoryLog:
    """What serving uses of a ``VbLog``: everything is in the in-memory tail."""

    def __init__(self, vbucket: int) -> None:
        self.vbucket = vbucket
        self.items: list[LogItem] = []
        self.high_seqno = 0
        self.purge_seqno = 0
        self.swapping = False
        self._changed = trio.Event()
        self._watchers: list[Callable[[], None]] = []
        self.tail = LogTail(64 << 20) if LogTail is not None else None

    def watch(self, wake: Callable[[], None]) -> Callable[[], None]:
        self._watchers.append(wake)
        return lambda: self._watchers.remove(wake)

    def publish(self, item: LogItem) -> None:
        self.items.append(item)
        if LogTail is not None:  # a block of one item per write, as the ingest logs it
            buffer = bytearray()
            close_block(buffer, buffer_items(buffer, -1, [item], 0, []))
            self.tail.add([(item.by_seqno, item.by_seqno, bytes(buffer))])
        self.high_seqno = item.by_seqno
        self._changed.set()
        self._changed = trio.Event()
        for wake in self._watchers:
            wake()

    async def wait_beyond(self, seqno: int) -> None:
        while self.high_seqno <= seqno:
            await self._changed.wait()

    async def segments_settled(self) -> None:
        return

    def in_memory(self, after: int) -> bool:
        return True

    def read(
        self, after: int, upto: int, limit: int, max_bytes: int | None = None
    ) -> list[LogItem]:
        # Seqnos are 1, 2, 3, ... here: the index is the seqno.
        return self.items[after : min(upto, self.high_seqno, after + limit)]

    def read_memory(self, after: int, upto: int, sink: Any) -> None:
        self.tail.read(after, min(upto, self.high_seqno), sink)


async def serve(rounds: int, touched: int, vbuckets: int, window: int) -> None:
    front = SimpleNamespace(
        dialect=DCP,
        config=SimpleNamespace(noop_interval=0.0),
        serves=lambda _vb: True,
        door=SimpleNamespace(answer=None),
        stats=SimpleNamespace(stream_ends_total={}),
        connections={},
    )
    left, right = trio.socket.socketpair()
    server_side, client_side = trio.SocketStream(left), trio.SocketStream(right)
    logs = [MemoryLog(vb) for vb in range(vbuckets)]
    received = 0
    wanted = 0
    arrived = trio.Event()
    async with trio.open_nursery() as nursery:
        packets = PacketConnection(server_side, name="consumer")
        packets.start_writer(nursery)
        stats = StreamStats("upr_front", "consumer", "tap")
        producer = UprConnection(front, packets, "consumer", upr.OpenFlags(0), stats)  # type: ignore[arg-type]
        producer._nursery = nursery
        if window:
            producer.window.set_buffer_size(window)

        async def read() -> None:
            nonlocal received
            while data := await client_side.receive_some(1 << 20):
                received += len(data)
                if window:  # acknowledge at once: the window never holds a round back
                    producer.window.acknowledged(len(data))
                    producer._room.set()
                if received >= wanted:
                    arrived.set()

        nursery.start_soon(read)
        for vb, log in enumerate(logs):
            request = upr.StreamRequest(end_seqno=2**64 - 1, opaque=vb + 1, vbucket=vb)
            stream = LogStream(producer, log, request)  # type: ignore[arg-type]
            producer.streams[vb] = stream
            nursery.start_soon(stream.run)
        await trio.testing.wait_all_tasks_blocked()
        chosen = [random.Random(n).sample(range(vbuckets), touched) for n in range(rounds)]
        value = b"v" * 100
        per_round = touched * (44 + 55 + 10 + 100)  # marker, mutation header and extras, key, value
        sends_before = packets.bytes_sent
        cpu = time.process_time()
        started = time.perf_counter()
        for n, vbs in enumerate(chosen):
            wanted += per_round
            arrived = trio.Event()
            for vb in vbs:
                log = logs[vb]
                seqno = log.high_seqno + 1
                log.publish(LogItem(seqno, ItemKind.MUTATION, b"key-%06d" % (n % 1000000), value,
                                    rev_seqno=seqno, checkpoint_id=seqno, checkpoint_start=True,
                                    arrival=time.time()))  # fmt: skip
            if received < wanted:
                await arrived.wait()
        cpu = time.process_time() - cpu
        elapsed = time.perf_counter() - started
        items = rounds * touched
        passes = getattr(getattr(producer, "live", None), "passes", None)
        print(
            f"{items:,} items in {rounds:,} rounds of {touched} vbuckets: "
            f"{cpu / items * 1e6:.2f} us CPU per item, {items / elapsed:,.0f} items/s; "
            f"{packets.bytes_sent - sends_before:,} bytes"
            + (f", {passes:,} sends" if passes is not None else ""),
            flush=True,
        )
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--touched", type=int, default=40)
    parser.add_argument("--vbuckets", type=int, default=64)
    parser.add_argument("--window", type=int, default=0, help="flow-control buffer (0: off)")
    args = parser.parse_args()
    trio.run(serve, args.rounds, args.touched, args.vbuckets, args.window)


if __name__ == "__main__":
    main()
