"""How fast the UPR front turns a TAP node's stream into UPR streams, and how big its log is.

Processes of their own over loopback: the reference node (N sample items,
the TAP upstream), the UPR front (state in a temporary directory, fsync per
batch), and this process, whose consumers only read and count; so the
figures are the gateway's own, not the node's or the readers'.

1. Ingest + serve: time from the gateway being up (it starts its ingest at
   once, with an empty log) until one consumer has received all N items
   (every vbucket streamed from 0), for 100-byte and 4 KB values; then the
   same with 10 consumers (items/s counts every consumer's items). Baseline
   in the same run, process for process: a source of the same number of
   pre-encoded UPR mutation frames of the same size (the node's place), a
   plain trio byte relay (the gateway's place), and the same readers. Also
   the node's own TAP backfill rate to a plain reader: the gateway cannot
   ingest faster than its upstream sends.
2. Log size on disk per million items, before and after compaction, for a
   workload where every key is written twice (node and gateway in this
   process: a size, not a speed).
3. Latency from a write on the node to its arrival at a UPR consumer, p50
   and p99, at a fixed write rate (node and gateway in their own processes;
   each value carries its send time).

    python bench/upr_front_bench.py [--items 100000] [--million] [--rate 10000]
                                    [--profile FILE]

``--profile FILE`` runs the gateway of the first throughput run under
cProfile and writes its stats to FILE (``python -m pstats FILE``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from node_stream_bench import tap_dump
from tap_front_bench import STAMP, relay, timed_writes

from adapters import upr
from adapters.mcbp import FrameReader
from gateway.fronts.upr import UprFront, UprFrontConfig
from gateway.io.connection import PacketConnection
from gateway.io.listen import bound_port
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store

VBUCKETS = 4
RECEIVE = 256 * 1024
MAX = 0xFFFFFFFFFFFFFFFF
MUTATION = upr.DCP.opcodes[upr.Command.MUTATION]
HERE = os.path.abspath(__file__)


# -- child processes ------------------------------------------------------------


@contextmanager
def process(command: list[str], pattern: str) -> Iterator[int]:
    """Run ``command``; yield the port its log line matching ``pattern`` names.

    Stopped with SIGTERM, which the children of this bench turn into
    KeyboardInterrupt (a profiled gateway writes its stats on the way out;
    SIGINT may be ignored in a child of a background job).
    """
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            found = re.search(pattern, line)
            if found:
                yield int(found.group(1))
                break
        else:
            raise SystemExit(f"{' '.join(command[:4])} did not start")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def node_process(items: int, value_size: int) -> AbstractContextManager[int]:
    command = [
        sys.executable, "-m", "gateway", "node", "--listen", "127.0.0.1:0",
        "--vbucket-count", str(VBUCKETS), "--sample-items", str(items),
        "--value-size", str(value_size), "--max-items", str(2 * items + 1_000_000),
    ]  # fmt: skip
    return process(command, r"listening on 127\.0\.0\.1:(\d+)")


def gateway_process(
    node_port: int, state: Path, profile: str | None = None
) -> AbstractContextManager[int]:
    command = [sys.executable, HERE, "--role", "gateway", "--target", str(node_port),
               "--state", str(state)]  # fmt: skip
    if profile:
        command += ["--profile", profile]
    return process(command, r"gateway on (\d+)")


async def run_gateway(node_port: int, state: Path) -> None:
    config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", node_port), state, compact_interval=0)
    front = UprFront(config)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(front.run)
        print(f"gateway on {port}", file=sys.stderr, flush=True)


async def run_source(items: int, value_size: int) -> None:
    """Serve ``items`` pre-encoded mutations to each connection, then close it."""
    frame = upr.encode(upr.Mutation(key=b"sample::000000", value=b"x" * value_size, by_seqno=1))
    payload = frame * items

    async def source(stream: trio.SocketStream) -> None:
        view = memoryview(payload)
        for i in range(0, len(payload), RECEIVE):
            await stream.send_all(view[i : i + RECEIVE])
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, source, 0)
        print(f"source on {bound_port(listeners)}", file=sys.stderr, flush=True)


async def run_relay(target: int) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay, target)
        print(f"relay on {port}", file=sys.stderr, flush=True)


def child(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.role == "gateway":
            if args.profile:
                import cProfile

                profiler = cProfile.Profile()
                try:
                    profiler.runcall(trio.run, run_gateway, args.target, Path(args.state))
                finally:
                    profiler.dump_stats(args.profile)
            else:
                trio.run(run_gateway, args.target, Path(args.state))
        elif args.role == "source":
            trio.run(run_source, args.items, args.value_size)
        else:
            trio.run(run_relay, args.target)
    except KeyboardInterrupt:
        pass


# -- readers --------------------------------------------------------------------


async def consume(port: int, name: bytes, wanted: int) -> None:
    """Stream every vbucket from 0 until ``wanted`` mutations arrived."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    events: list[upr.UprEvent] = [upr.Open(name, upr.OpenFlags.PRODUCER, opaque=1)]
    events += [
        upr.StreamRequest(start_seqno=0, end_seqno=MAX, opaque=10 + vb, vbucket=vb)
        for vb in range(VBUCKETS)
    ]
    await stream.send_all(b"".join(upr.encode(e) for e in events))
    reader = FrameReader()
    count = 0
    while count < wanted:
        data = await stream.receive_some(RECEIVE)
        if not data:
            raise SystemExit(f"{name!r}: the gateway closed after {count} of {wanted} items")
        reader.receive_data(data)
        for frame in reader.frames():
            if frame.opcode == MUTATION and frame.magic == 0x80:
                count += 1
    await stream.aclose()


async def sink(port: int, wanted: int) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    reader = FrameReader()
    count = 0
    while count < wanted:
        data = await stream.receive_some(RECEIVE)
        if not data:
            break
        reader.receive_data(data)
        count += len(reader.frames())
    await stream.aclose()


async def vbuckets_ready(port: int) -> None:
    """Until the gateway serves every vbucket (its ingest opened the logs and connects)."""
    while True:
        async with await PacketConnection.connect("127.0.0.1", port) as client:
            seqnos = await client.stats("vbucket-seqno")
        if sum(k.endswith(":high_seqno") for k in seqnos) >= VBUCKETS:
            return
        await trio.sleep(0.01)


async def timed_consumers(port: int, consumers: int, n: int) -> float:
    await vbuckets_ready(port)
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(consumers):
            nursery.start_soon(consume, port, b"bench-%d" % i, n)
    return time.perf_counter() - started


async def timed_sinks(port: int, sinks: int, n: int) -> float:
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(sinks):
            nursery.start_soon(sink, port, n)
    return time.perf_counter() - started


def node_tap_rate(n: int, value_size: int) -> float:
    """Items/s of the node's own TAP backfill to a client that only reads: the ceiling
    of the gateway's ingest (which also acks and logs)."""
    with node_process(n, value_size) as node_port:
        count, _, elapsed = trio.run(tap_dump, node_port)
    return count / elapsed


def throughput(n: int, value_size: int, consumers: int, profile: str | None) -> tuple[float, float]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        node_process(n, value_size) as node_port,
        gateway_process(node_port, Path(tmp), profile) as port,
    ):
        gateway = trio.run(timed_consumers, port, consumers, n)
    source = [sys.executable, HERE, "--role", "source", "--items", str(n),
              "--value-size", str(value_size)]  # fmt: skip
    with process(source, r"source on (\d+)") as source_port:
        relay_cmd = [sys.executable, HERE, "--role", "relay", "--target", str(source_port)]
        with process(relay_cmd, r"relay on (\d+)") as relay_port:
            baseline = trio.run(timed_sinks, relay_port, consumers, n)
    # Items delivered per second, over all consumers.
    return n * consumers / gateway, n * consumers / baseline


# -- log size (in process) ------------------------------------------------------


async def log_size(n: int) -> tuple[float, float]:
    store = Store(VBUCKETS, max_items=n * 2)
    half = n // 2
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            node = Node(store, NodeConfig(vbuckets=VBUCKETS, checkpoint_interval=0.5))
            node_port = bound_port(await nursery.start(node.serve, "127.0.0.1", 0))
            config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", node_port), Path(tmp),
                                    compact_interval=0, segment_bytes=256 * 1024)  # fmt: skip
            front = UprFront(config)
            await nursery.start(front.run)
            for round_ in range(2):  # each key twice: the second round overwrites
                rng = random.Random(round_)
                store.populate_sample(half, value_size=100, now=time.time(), rng=rng)
                while sum(v.items_total for v in front.logs) < (round_ + 1) * half:
                    await trio.sleep(0.05)
            before = sum(v.bytes_on_disk() for v in front.logs)
            await front.compact()
            after = sum(v.bytes_on_disk() for v in front.logs)
            nursery.cancel_scope.cancel()
    per_million = 1_000_000 / (2 * half)
    return before * per_million, after * per_million


# -- latency (node and gateway in their own processes) ----------------------------


async def latency_run(node_port: int, port: int, rate: int, seconds: float) -> list[float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    events: list[upr.UprEvent] = [upr.Open(b"latency", upr.OpenFlags.PRODUCER, opaque=1)]
    events += [upr.StreamRequest(start_seqno=0, end_seqno=MAX, opaque=10 + vb, vbucket=vb)
               for vb in range(VBUCKETS)]  # fmt: skip
    delays: list[float] = []

    async def arrivals() -> None:
        reader = FrameReader()
        while data := await stream.receive_some(RECEIVE):
            now = time.time()
            reader.receive_data(data)
            for frame in reader.frames():
                if frame.opcode == MUTATION and frame.key.startswith(b"lat::"):
                    delays.append(now - STAMP.unpack_from(frame.value)[0])

    async with trio.open_nursery() as nursery:
        await vbuckets_ready(port)
        await stream.send_all(b"".join(upr.encode(e) for e in events))
        nursery.start_soon(arrivals)
        await trio.sleep(0.5)
        sent = await timed_writes(node_port, rate, seconds, VBUCKETS)
        with trio.move_on_after(10):
            while len(delays) < sent:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    await stream.aclose()
    return delays


def latency(rate: int, seconds: float) -> list[float]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        node_process(0, 100) as node_port,
        gateway_process(node_port, Path(tmp)) as port,
    ):
        return trio.run(latency_run, node_port, port, rate, seconds)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def main(args: argparse.Namespace) -> None:
    n = 1_000_000 if args.million else args.items
    print(f"UPR front bench: {VBUCKETS} vbuckets, fsync=batch, node/gateway/readers in "
          "processes of their own over loopback")  # fmt: skip
    profile = args.profile
    for value_size, items in ((100, n), (4096, max(1000, n // 10) if not args.million else n)):
        print(
            f"  {items:>8} x {value_size:>4} B: the node's own TAP backfill "
            f"{node_tap_rate(items, value_size):>9,.0f} items/s (the ingest's ceiling)",
            flush=True,
        )
        for consumers in (1, 10):
            gateway, relay_rate = throughput(items, value_size, consumers, profile)
            profile = None
            print(
                f"  {items:>8} x {value_size:>4} B, {consumers:>2} consumer(s): "
                f"gateway {gateway:>9,.0f} items/s   byte relay {relay_rate:>10,.0f} items/s   "
                f"ratio {gateway / relay_rate:.2f}",
                flush=True,
            )
    before, after = trio.run(log_size, args.log_items)
    print(
        f"  log on disk per million items (each key written twice, 100 B values): "
        f"{before / 2**20:,.0f} MiB before compaction, {after / 2**20:,.0f} MiB after"
    )
    delays = latency(args.rate, args.seconds)
    if len(delays) < 2:
        print("  write->arrival latency: no samples")
        return
    print(
        f"  write->arrival latency at {args.rate} writes/s for {args.seconds:g}s: "
        f"p50 {percentile(delays, 0.5) * 1000:.2f} ms, "
        f"p99 {percentile(delays, 0.99) * 1000:.2f} ms, "
        f"mean {statistics.fmean(delays) * 1000:.2f} ms ({len(delays)} items)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--million", action="store_true", help="1M items (and 1M 4 KB items)")
    parser.add_argument("--log-items", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--profile", help="cProfile the first gateway run into this file")
    parser.add_argument("--role", choices=("gateway", "source", "relay"), help=argparse.SUPPRESS)
    parser.add_argument("--target", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--value-size", type=int, default=100, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.role:
        child(arguments)
    else:
        main(arguments)
