"""The UPR front's live path in one process: TAP reads in, UPR frames out, no other process.

    PYTHONPATH=. python bench/upr_live_bench.py [--rate 20000] [--per-read 20]
        [--seconds 3] [--vbuckets 64] [--fsync batch] [--profile FILE]

The ingest's own loop (``Ingest._stream_in_place``) reads from a stand-in
for its upstream socket that hands it, every ``per-read / rate`` seconds,
one read of ``--per-read`` one-item TAP checkpoints (CHECKPOINT_START, the
item, CHECKPOINT_END, each asking for an ack, as ``inmem.TapLiveFeed``
sends them) on as many vbuckets; the logs are real (a temporary directory,
the group commit and its fsyncs as configured), and one UPR consumer (a
socket pair, read in this process) follows every vbucket live. Prints the
process's CPU per item (the consumer's reads and the fsync threads
included, the same for any version of the gateway code) and the latency
from the read's hand-over to the consumer's receive (p50/p99/p99.9): the
gateway's own, with no upstream, relay or reader process in the way, so it
is steadier than ``throughput.py``'s on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inmem import STAMP, TapLiveFeed

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.upr.dialect import DCP
from gateway.fronts.upr.commit import GroupCommit
from gateway.fronts.upr.config import UprFrontConfig
from gateway.fronts.upr.ingest import Ingest
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.fronts.upr.producer import UprConnection
from gateway.fronts.upr.streams import LogStream
from gateway.io.connection import PacketConnection
from gateway.metrics.figures import GatewayStats, StreamStats
from gateway.runtime.loop_watch import LoopWatch, freeze_startup_objects

_KEY = re.compile(rb"live::\d{12}")


class Upstream:
    """What the ingest reads from: one read of the feed every ``interval`` seconds."""

    def __init__(self, feed: TapLiveFeed, per_read: int, interval: float, items: int) -> None:
        self.feed = feed
        self.per_read = per_read
        self.interval = interval
        self.items = items
        self.sent = 0
        self.started = 0.0

    async def receive_some(self, max_bytes: int) -> bytes:
        if self.sent >= self.items:
            await trio.sleep_forever()
        if self.interval:
            due = self.started + self.sent / self.per_read * self.interval
            if due > trio.current_time():
                await trio.sleep_until(due)
        else:
            await trio.lowlevel.checkpoint()
        stamp = STAMP.pack(time.time())
        count = min(self.per_read, self.items - self.sent)
        data = b"".join(self.feed.frames(self.sent + n, stamp) for n in range(count))
        self.sent += count
        return data

    async def send_all(self, data: bytes) -> None:
        """The acks and replies: the producer reads them, nothing to measure here."""


async def run(args: argparse.Namespace) -> None:
    vbuckets = tuple(range(args.vbuckets))
    interval = args.per_read / args.rate if args.rate else 0.0
    items = int(args.rate * args.seconds) if args.rate else args.items
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", 0), root, fsync=args.fsync)
        logs = LogSet(root, LogOptions(fsync=args.fsync), GatewayStats(), seed=1)
        ingest = Ingest(config, logs, GatewayStats(), vbuckets=vbuckets)
        ingest._logs = {v.vbucket: v for v in await logs.ensure_all(vbuckets)}
        front = SimpleNamespace(
            dialect=DCP, config=SimpleNamespace(noop_interval=0.0), serves=lambda _vb: True,
            door=SimpleNamespace(answer=None), stats=SimpleNamespace(stream_ends_total={}),
            connections={},
        )  # fmt: skip
        left, right = trio.socket.socketpair()
        server_side, client_side = trio.SocketStream(left), trio.SocketStream(right)
        upstream = Upstream(TapLiveFeed(args.rate or 1000.0, args.vbuckets), args.per_read,
                            interval, items)  # fmt: skip
        latencies: list[float] = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            packets = PacketConnection(server_side, name="consumer")
            packets.start_writer(nursery)
            stats = StreamStats("upr_front", "consumer", "tap")
            producer = UprConnection(front, packets, "consumer", upr.OpenFlags(0), stats)  # type: ignore[arg-type]
            producer._nursery = nursery
            front.connections[0] = producer

            async def consume() -> None:
                received = 0
                while data := await client_side.receive_some(1 << 20):
                    now = time.time()
                    for found in _KEY.finditer(data):
                        latencies.append(now - STAMP.unpack_from(data, found.end())[0])
                        received += 1
                    if received >= items:
                        done.set()

            nursery.start_soon(consume)
            for vb in vbuckets:
                request = upr.StreamRequest(end_seqno=2**64 - 1, opaque=vb + 1, vbucket=vb)
                stream = LogStream(producer, ingest._logs[vb], request)
                producer.streams[vb] = stream
                nursery.start_soon(stream.run)
            await trio.sleep(0.2)  # every stream caught up (empty logs) and followed
            group = None
            if args.fsync != "always":
                group = GroupCommit(ingest._commit_now, upstream.send_all,
                                    early=args.fsync == "batch")  # fmt: skip
                nursery.start_soon(group.run)
                ingest._group = group
            freeze_startup_objects()  # as ``serve`` does
            watch = LoopWatch()
            nursery.start_soon(watch.run)
            profiler = None
            if args.profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            cpu = time.process_time()
            started = upstream.started = trio.current_time()
            nursery.start_soon(ingest._stream_in_place, FrameReader(), upstream, group)  # type: ignore[arg-type]
            with trio.move_on_after(args.seconds + 30):
                await done.wait()
            elapsed = trio.current_time() - started
            cpu = time.process_time() - cpu
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(args.profile)
            nursery.cancel_scope.cancel()
        logs.close()
    got = len(latencies)
    cuts = statistics.quantiles(latencies, n=1000) if got > 1 else [0.0] * 999
    print(
        f"{got:,}/{items:,} items, {args.per_read} per read"
        + (f" at {args.rate:,.0f}/s" if args.rate else ", unpaced")
        + f", fsync {args.fsync}: {items / elapsed:,.0f} items/s, "
        f"{cpu / max(1, got) * 1e6:.1f} us CPU per item; latency p50 {cuts[499] * 1e3:.2f} "
        f"p99 {cuts[989] * 1e3:.2f} p99.9 {cuts[998] * 1e3:.2f} ms",
        flush=True,
    )
    commits = f"{group.commits} commits, " if group is not None else ""
    print(f"  {commits}{watch.summary()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=20000.0, help="items/s (0: unpaced)")
    parser.add_argument("--per-read", type=int, default=20, help="items per upstream read")
    parser.add_argument("--items", type=int, default=60000, help="items when unpaced")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--vbuckets", type=int, default=64)
    parser.add_argument("--fsync", default="batch", choices=("always", "batch", "never"))
    parser.add_argument("--profile", help="cProfile the run into this file")
    parser.add_argument(
        "--no-fsync-calls", action="store_true",
        help="fsync batch with each fsync a no-op: what the fsyncs themselves cost",
    )  # fmt: skip
    args = parser.parse_args()
    if args.no_fsync_calls:
        from gateway.fronts.upr.segment_file import SegmentFile

        SegmentFile.sync = lambda self: None  # type: ignore[method-assign]
    trio.run(run, args)


if __name__ == "__main__":
    main()
