"""Throughput, added latency and memory of the TAP front.

Starts the reference node and the gateway (``serve --upr-upstream``) in
processes of their own, then measures, in one run:

1. backfill throughput: a TAP client dumps every item through the TAP front,
   beside the baseline, the same items read as UPR streams through a plain
   trio byte relay over the same node (what forwarding bytes alone costs);
   the ratio is the figure. Run once with 100-byte and once with 4 KB values;
2. added latency of a live mutation: writes at a fixed rate carry their send
   time in the value; a TAP client through the gateway and a UPR consumer
   straight on the node time each arrival (p50/p99 of both, per rate);
3. the gateway's peak RSS with many concurrent TAP clients backfilling.

    python bench/tap_front_bench.py [--items N] [--rates 10000,50000] [--clients 100]
"""

from __future__ import annotations

import argparse
import re
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import trio
from node_stream_bench import memory_kib, read_frames, report, upr_streams

from adapters import tap, upr
from adapters.mcbp import FrameReader, Magic, Opcode, encode_frame
from adapters.mcbp.vbucket import vbucket_of
from gateway.io.connection import PacketConnection

RECEIVE = 256 * 1024
STAMP = struct.Struct(">d")


@contextmanager
def process(command: list[str], pattern: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Run ``command``; yield it with the port its log line matching ``pattern`` names."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            found = re.search(pattern, line)
            if found:
                yield proc, int(found.group(1))
                break
        else:
            raise SystemExit(f"{command[3]} did not start")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def node_command(items: int, value_size: int, vbuckets: int) -> list[str]:
    return [
        sys.executable, "-m", "gateway", "node", "--listen", "127.0.0.1:0",
        "--vbucket-count", str(vbuckets), "--sample-items", str(items),
        "--value-size", str(value_size), "--max-items", str(2 * items + 1_000_000),
    ]  # fmt: skip


def gateway_command(node_port: int) -> list[str]:
    return [
        sys.executable, "-m", "gateway", "serve", "--upr-upstream", f"127.0.0.1:{node_port}",
        "--tap-listen", "127.0.0.1:0", "--no-metrics",
    ]  # fmt: skip


async def high_seqnos(port: int) -> dict[int, int]:
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        stats = await client.stats("vbucket-seqno")
    return {
        int(k[3:].split(":")[0]): int(v)
        for k, v in stats.items()
        if k.endswith(":high_seqno") and int(v)
    }


async def tap_dump(port: int, name: bytes = b"bench") -> tuple[int, int, float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    flags = tap.ConnectFlags.BACKFILL | tap.ConnectFlags.DUMP
    started = time.perf_counter()
    await stream.send_all(tap.encode(tap.TapConnect(name, flags, backfill_date=0)))
    count, total = await read_frames(stream, tap.TapOpcode.MUTATION, None, 0)
    elapsed = time.perf_counter() - started
    await stream.aclose()
    return count, total, elapsed


async def relay_baseline(node_port: int, highs: dict[int, int]) -> tuple[int, int, float]:
    """UPR streams of every vbucket through a trio byte relay run in a child process."""
    code = (
        "import sys, trio; sys.path.insert(0, 'bench'); import inmem;"
        f"trio.run(inmem.relay_main, {node_port})"
    )
    with process([sys.executable, "-c", code, "relay"], r"relay on (\d+)") as (_, port):
        return await upr_streams(port, highs)


def throughput(items: int, value_size: int, vbuckets: int) -> None:
    print(f"\n== backfill of {items:,} items of {value_size} bytes ({vbuckets} vbuckets)")
    with (
        process(node_command(items, value_size, vbuckets), r"listening on 127\.0\.0\.1:(\d+)") as (
            _,
            node_port,
        ),
        process(gateway_command(node_port), r"TAP front listening on 127\.0\.0\.1:(\d+)") as (
            gateway,
            tap_port,
        ),
    ):
        highs = trio.run(high_seqnos, node_port)
        base = report("baseline: UPR via a byte relay", *trio.run(relay_baseline, node_port, highs))
        rate = report("TAP front (dump)", *trio.run(tap_dump, tap_port))
        print(f"  {'':<34} {rate / base:.2f} of the baseline")
        peak = memory_kib(gateway.pid)
        print(f"  gateway RSS {peak['VmRSS'] / 1024:.0f} MiB, peak {peak['VmHWM'] / 1024:.0f} MiB")


async def timed_writes(port: int, rate: float, seconds: float, vbuckets: int) -> int:
    """SETs whose value starts with their send time, ``rate`` per second."""
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        batch = max(1, int(rate / 200))
        started = time.monotonic()
        sent = 0
        while time.monotonic() - started < seconds:
            packets = []
            for _ in range(batch):
                key = b"lat::%d" % sent
                packets.append(
                    encode_frame(
                        Magic.REQUEST,
                        Opcode.SET,
                        vbucket_or_status=vbucket_of(key, vbuckets),
                        opaque=sent,
                        extras=b"\0" * 8,
                        key=key,
                        value=STAMP.pack(time.time()) + b"v" * 92,
                    )
                )
                sent += 1
            await client.send(b"".join(packets))
            for _ in range(batch):
                await client.next_frame()
            ahead = sent / rate - (time.monotonic() - started)
            if ahead > 0:
                await trio.sleep(ahead)
    return sent


async def arrivals(stream: trio.abc.Stream, protocol: str, out: list[float]) -> None:
    """Record now - send time for every mutation whose key is a timed write's."""
    reader = FrameReader()
    mutation = (
        tap.TapOpcode.MUTATION if protocol == "tap" else upr.DCP.opcodes[upr.Command.MUTATION]
    )
    while data := await stream.receive_some(RECEIVE):
        now = time.time()
        reader.receive_data(data)
        while (frame := reader.next_frame()) is not None:
            if frame.opcode != mutation:
                continue
            event = tap.decode_frame(frame) if protocol == "tap" else upr.decode_frame(frame)
            if event.key.startswith(b"lat::"):  # type: ignore[union-attr]
                out.append(now - STAMP.unpack_from(event.value)[0])  # type: ignore[union-attr]


async def latency_run(node_port: int, tap_port: int, rate: float, vbuckets: int) -> None:
    seconds = 3.0
    via_gateway: list[float] = []
    direct: list[float] = []
    tap_client = await trio.open_tcp_stream("127.0.0.1", tap_port)
    await tap_client.send_all(tap.encode(tap.TapConnect(b"latency", tap.ConnectFlags(0))))
    upr_client = await trio.open_tcp_stream("127.0.0.1", node_port)
    async with await PacketConnection.connect("127.0.0.1", node_port) as client:
        seqnos = await client.stats("vbucket-seqno")
    requests = [upr.encode(upr.Open(name=b"lat", flags=upr.OpenFlags.PRODUCER, opaque=1))]
    for vb in range(vbuckets):
        high, uuid = int(seqnos[f"vb_{vb}:high_seqno"]), int(seqnos[f"vb_{vb}:uuid"])
        requests.append(
            upr.encode(
                upr.StreamRequest(
                    opaque=100 + vb, vbucket=vb, start_seqno=high, end_seqno=(1 << 64) - 1,
                    vbucket_uuid=uuid, snap_start_seqno=high, snap_end_seqno=high,
                )
            )
        )  # fmt: skip
    await upr_client.send_all(b"".join(requests))
    await trio.sleep(0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrivals, tap_client, "tap", via_gateway)
        nursery.start_soon(arrivals, upr_client, "upr", direct)
        sent = await timed_writes(node_port, rate, seconds, vbuckets)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    print(f"  {rate:>8,.0f} writes/s target: {sent / seconds:,.0f} sent/s")
    for label, samples in (
        ("UPR straight from the node", direct),
        ("TAP via the gateway", via_gateway),
    ):
        if len(samples) < 2:
            print(f"    {label:<28} no samples")
            continue
        cuts = statistics.quantiles(samples, n=100)
        print(
            f"    {label:<28} n={len(samples):>7,} p50 {cuts[49] * 1e3:7.2f} ms  "
            f"p99 {cuts[98] * 1e3:7.2f} ms"
        )
    if len(direct) > 1 and len(via_gateway) > 1:
        d, g = statistics.quantiles(direct, n=100), statistics.quantiles(via_gateway, n=100)
        print(
            f"    added by the gateway: p50 {(g[49] - d[49]) * 1e3:+.2f} ms, "
            f"p99 {(g[98] - d[98]) * 1e3:+.2f} ms"
        )
    await tap_client.aclose()
    await upr_client.aclose()


def latency(rates: list[float], vbuckets: int) -> None:
    print("\n== live mutation latency (write on the node -> arrival at the client)")
    with (
        process(node_command(0, 100, vbuckets), r"listening on 127\.0\.0\.1:(\d+)") as (
            _,
            node_port,
        ),
        process(gateway_command(node_port), r"TAP front listening on 127\.0\.0\.1:(\d+)") as (
            _,
            tap_port,
        ),
    ):
        for rate in rates:
            trio.run(latency_run, node_port, tap_port, rate, vbuckets)


async def many_clients(port: int, clients: int) -> float:
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(clients):
            nursery.start_soon(partial(tap_dump, port, b"client-%d" % index))
    return time.perf_counter() - started


def memory(clients: int, items: int, vbuckets: int) -> None:
    print(f"\n== {clients} concurrent TAP clients, each dumping {items:,} items")
    with (
        process(node_command(items, 100, vbuckets), r"listening on 127\.0\.0\.1:(\d+)") as (
            _,
            node_port,
        ),
        process(gateway_command(node_port), r"TAP front listening on 127\.0\.0\.1:(\d+)") as (
            gateway,
            tap_port,
        ),
    ):
        idle = memory_kib(gateway.pid)
        elapsed = trio.run(many_clients, tap_port, clients)
        peak = memory_kib(gateway.pid)
        print(
            f"  {clients * items:,} items delivered in {elapsed:.1f}s "
            f"({clients * items / elapsed:,.0f} items/s in all)"
        )
        print(
            f"  gateway RSS idle {idle['VmRSS'] / 1024:.0f} MiB, "
            f"peak {peak['VmHWM'] / 1024:.0f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000, help="items for 100-byte values")
    parser.add_argument("--large-items", type=int, default=100_000, help="items for 4 KB values")
    parser.add_argument("--vbuckets", type=int, default=64)
    parser.add_argument("--rates", default="10000,50000", help="write rates for the latency run")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--client-items", type=int, default=10_000)
    args = parser.parse_args()
    throughput(args.items, 100, args.vbuckets)
    throughput(args.large_items, 4096, args.vbuckets)
    latency([float(r) for r in args.rates.split(",")], args.vbuckets)
    memory(args.clients, args.client_items, args.vbuckets)


if __name__ == "__main__":
    main()
