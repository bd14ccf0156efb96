"""How fast the UPR front turns a TAP node's stream into UPR streams, and how big its log is.

Everything runs in one trio process over loopback: a reference node holding
N sample items (the TAP upstream), the UPR front (state in a temporary
directory, fsync per batch), and consumers that only read and count.

1. Ingest + serve: time from starting the gateway until one consumer has
   received all N items (every vbucket streamed from 0), for 100-byte and
   4 KB values; then the same with 10 consumers (items/s counts every
   consumer's items). Baseline in the same run: a
   plain trio byte relay (upstream socket -> relay -> consumer socket) of the
   same number of pre-encoded UPR mutation frames of the same size.
2. Log size on disk per million items, before and after compaction, for a
   workload where every key is written twice.
3. Latency from a write on the node to its arrival at a UPR consumer, p50
   and p99, at a fixed write rate.

    python bench/upr_front_bench.py [--items 100000] [--million] [--rate 10000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import FrameReader
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store
from gateway.uprfront import UprFront, UprFrontConfig
from gateway.wire import bound_port

VBUCKETS = 4
RECEIVE = 256 * 1024
MAX = 0xFFFFFFFFFFFFFFFF
MUTATION = upr.DCP.opcodes[upr.Command.MUTATION]


async def start_node(nursery: trio.Nursery, store: Store) -> int:
    node = Node(store, NodeConfig(vbuckets=VBUCKETS, checkpoint_interval=0.5))
    listeners = await nursery.start(node.serve, "127.0.0.1", 0)
    return bound_port(listeners)


async def start_front(nursery: trio.Nursery, node_port: int, state: Path, **kw: object) -> UprFront:
    config = UprFrontConfig(
        ("127.0.0.1", 0), ("127.0.0.1", node_port), state, compact_interval=0, **kw
    )  # type: ignore[arg-type]
    front = UprFront(config)
    await nursery.start(front.run)
    return front


async def consume(port: int, name: bytes, wanted: int, done: trio.Event | None = None) -> float:
    """Stream every vbucket from 0; seconds until ``wanted`` mutations arrived."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    events = [upr.Open(name, upr.OpenFlags.PRODUCER, opaque=1)]
    events += [
        upr.StreamRequest(start_seqno=0, end_seqno=MAX, opaque=10 + vb, vbucket=vb)
        for vb in range(VBUCKETS)
    ]
    await stream.send_all(b"".join(upr.encode(e) for e in events))
    reader = FrameReader()
    started = time.perf_counter()
    count = 0
    while count < wanted:
        data = await stream.receive_some(RECEIVE)
        if not data:
            break
        reader.receive_data(data)
        for frame in reader.frames():
            if frame.opcode == MUTATION and frame.magic == 0x80:
                count += 1
    elapsed = time.perf_counter() - started
    await stream.aclose()
    if done is not None:
        done.set()
    return elapsed


async def relay_baseline(n: int, value_size: int, consumers: int) -> float:
    """Seconds to relay n pre-encoded mutations through a trio byte relay to each consumer."""
    frame = upr.encode(upr.Mutation(key=b"sample::000000", value=b"x" * value_size, by_seqno=1))
    payload = frame * n
    async with trio.open_nursery() as nursery:

        async def source(stream: trio.SocketStream) -> None:
            view = memoryview(payload)
            for i in range(0, len(payload), RECEIVE):
                await stream.send_all(view[i : i + RECEIVE])
            await stream.aclose()

        async def relay(stream: trio.SocketStream) -> None:
            upstream = await trio.open_tcp_stream("127.0.0.1", source_port)
            while data := await upstream.receive_some(RECEIVE):
                await stream.send_all(data)
            await stream.aclose()

        src = await nursery.start(trio.serve_tcp, source, 0)
        source_port = bound_port(src)
        rel = await nursery.start(trio.serve_tcp, relay, 0)
        relay_port = bound_port(rel)

        async def sink() -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", relay_port)
            reader = FrameReader()
            count = 0
            while count < n:
                data = await stream.receive_some(RECEIVE)
                if not data:
                    break
                reader.receive_data(data)
                count += len(reader.frames())

        started = time.perf_counter()
        async with trio.open_nursery() as sinks:
            for _ in range(consumers):
                sinks.start_soon(sink)
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return elapsed


async def throughput(n: int, value_size: int, consumers: int) -> tuple[float, float]:
    store = Store(VBUCKETS, max_items=n * 2)
    written = store.populate_sample(n, value_size=value_size, now=time.time())
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            node_port = await start_node(nursery, store)
            started = time.perf_counter()
            front = await start_front(nursery, node_port, Path(tmp))
            async with trio.open_nursery() as readers:
                for i in range(consumers):
                    readers.start_soon(consume, front.port, b"bench-%d" % i, written)
            gateway = time.perf_counter() - started
            nursery.cancel_scope.cancel()
    relay = await relay_baseline(written, value_size, consumers)
    # Items delivered per second, over all consumers.
    return written * consumers / gateway, written * consumers / relay


async def log_size(n: int) -> tuple[float, float]:
    store = Store(VBUCKETS, max_items=n * 2)
    half = n // 2
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            node_port = await start_node(nursery, store)
            front = await start_front(nursery, node_port, Path(tmp), segment_bytes=256 * 1024)
            for round_ in range(2):  # each key twice: the second round overwrites
                rng = random.Random(round_)
                store.populate_sample(half, value_size=100, now=time.time(), rng=rng)
                while sum(v.items_total for v in front.logs) < (round_ + 1) * half:
                    await trio.sleep(0.05)
            for v in front.logs:
                v.write()
                v.publish()
            before = sum(v.bytes_on_disk() for v in front.logs)
            await front.compact()
            after = sum(v.bytes_on_disk() for v in front.logs)
            nursery.cancel_scope.cancel()
    per_million = 1_000_000 / (2 * half)
    return before * per_million, after * per_million


async def latency(rate: int, seconds: float) -> list[float]:
    store = Store(VBUCKETS)
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            node_port = await start_node(nursery, store)
            front = await start_front(nursery, node_port, Path(tmp))
            stream = await trio.open_tcp_stream("127.0.0.1", front.port)
            events = [upr.Open(b"latency", upr.OpenFlags.PRODUCER, opaque=1)]
            events += [upr.StreamRequest(start_seqno=0, end_seqno=MAX, opaque=10 + vb, vbucket=vb)
                       for vb in range(VBUCKETS)]  # fmt: skip
            await stream.send_all(b"".join(upr.encode(e) for e in events))
            written: dict[bytes, float] = {}
            delays: list[float] = []
            total = int(rate * seconds)

            async def writer() -> None:
                start = trio.current_time()
                for i in range(total):
                    due = start + i / rate
                    if due > trio.current_time():
                        await trio.sleep_until(due)
                    key = b"lat-%d" % i
                    written[key] = trio.current_time()
                    store.set(i % VBUCKETS, key, b"v" * 100, now=time.time())

            nursery.start_soon(writer)
            reader = FrameReader()
            while len(delays) < total:
                data = await stream.receive_some(RECEIVE)
                now = trio.current_time()
                reader.receive_data(data)
                for frame in reader.frames():
                    if frame.opcode == MUTATION and frame.magic == 0x80:
                        sent = written.get(frame.key)
                        if sent is not None:
                            delays.append(now - sent)
            nursery.cancel_scope.cancel()
    return delays


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


async def main(args: argparse.Namespace) -> None:
    n = 1_000_000 if args.million else args.items
    print(f"UPR front bench: {VBUCKETS} vbuckets, fsync=batch, in one process over loopback")
    for value_size, items in ((100, n), (4096, max(1000, n // 10) if not args.million else n)):
        for consumers in (1, 10):
            gateway, relay = await throughput(items, value_size, consumers)
            print(
                f"  {items:>8} x {value_size:>4} B, {consumers:>2} consumer(s): "
                f"gateway {gateway:>9,.0f} items/s   byte relay {relay:>10,.0f} items/s   "
                f"ratio {gateway / relay:.2f}"
            )
    before, after = await log_size(args.log_items)
    print(
        f"  log on disk per million items (each key written twice, 100 B values): "
        f"{before / 2**20:,.0f} MiB before compaction, {after / 2**20:,.0f} MiB after"
    )
    delays = await latency(args.rate, args.seconds)
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
    trio.run(main, parser.parse_args())
