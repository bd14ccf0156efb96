"""/metrics render time: 1,000 streams, and per-vbucket series for 100 streams x 64 vbuckets.

Baselines measured in the same run: rendering an empty registry (the fixed
cost of the exposition code) and a gateway with no streams. For each case:
the capture on the trio thread (the only part that holds up the streams),
the render to Prometheus text and to OpenMetrics in the calling thread, the
body size, and a full HTTP scrape of ``serve_metrics`` over loopback with
the longest stall a 1 ms ticker on the trio loop saw meanwhile (rendering
runs in a worker thread, so that stall should stay far below the render).

    python bench/metrics_bench.py [--streams N] [--vbuckets V] [--repeat R]
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import time
from collections.abc import Callable
from functools import partial

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from gateway.metrics import register_gateway_metrics, serve_metrics
from gateway.metrics.collector import GatewayCollector
from gateway.stats import ITEM_KINDS, TAP_FRONT, UPR_FRONT, GatewayStats, StreamStats


def populate(streams: int, vbuckets: int) -> GatewayStats:
    stats = GatewayStats()
    now = time.time()
    for i in range(streams):
        direction = TAP_FRONT if i % 2 else UPR_FRONT
        stream = StreamStats(direction, f"conn-{i:04d}", f"node-{i % 4}:11210", created=now)
        stats.streams[id(stream)] = stream
        for n, kind in enumerate(ITEM_KINDS):
            stream.items_sent[kind] = 1000 * (n + 1) + i
        stream.bytes_sent, stream.last_item_time = 10_000_000 + i, now
        stream.buffer_size, stream.unacked_bytes = 1 << 20, 4096
        stream.acks_pending, stream.ack_window, stream.oldest_unacked_time = 3, 64, now - 0.2
        for n in range(50):
            stream.latency.observe(0.0005 * (n + 1))
        for vb in range(vbuckets):
            p = stream.vbucket((i * 7 + vb) % 1024)
            p.upstream_high_seqno, p.sent_seqno, p.acked_seqno = 5000 + vb, 4990 + vb, 4980
            p.backfilling, p.backfill_end_seqno = vb % 16 == 0, 6000
    return stats


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


async def http_scrape(stats: GatewayStats, per_vbucket: bool, repeat: int) -> tuple[float, float]:
    """(median scrape seconds, longest trio-loop stall seconds) over ``repeat`` scrapes."""
    stalls: list[float] = []
    scrape_times: list[float] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(serve_metrics, stats, "127.0.0.1", 0, per_vbucket=per_vbucket)
        )
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        request = b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept-Encoding: gzip\r\n\r\n"
        done = trio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await trio.sleep(0.001)
                now = time.perf_counter()
                stalls.append(now - last - 0.001)
                last = now

        nursery.start_soon(ticker)
        for _ in range(repeat):
            start = time.perf_counter()
            await stream.send_all(request)
            buffer = b""
            while b"\r\n\r\n" not in buffer:
                buffer += await stream.receive_some(1 << 20)
            head, _, body = buffer.partition(b"\r\n\r\n")
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += await stream.receive_some(1 << 20)
            scrape_times.append(time.perf_counter() - start)
        done.set()
        await stream.aclose()
        nursery.cancel_scope.cancel()
    return statistics.median(scrape_times), max(stalls, default=0.0)


def report(label: str, stats: GatewayStats | None, per_vbucket: bool, repeat: int) -> None:
    registry = CollectorRegistry()
    if stats is not None:
        register_gateway_metrics(registry, stats, per_vbucket=per_vbucket)
    text = generate_latest(registry)
    render = best(lambda: generate_latest(registry), repeat)
    render_om = best(lambda: openmetrics_latest(registry), repeat)
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    line = (
        f"{label:<44} {series:>8} series  {len(text) / 1024:>8.0f} KiB "
        f"({len(gzip.compress(text, 1)) / 1024:>6.0f} gz)  text {render * 1000:>8.2f} ms  "
        f"openmetrics {render_om * 1000:>8.2f} ms"
    )
    if stats is not None:
        collector = GatewayCollector(stats, per_vbucket=per_vbucket)
        capture = best(collector.capture, repeat)
        scrape, stall = trio.run(http_scrape, stats, per_vbucket, repeat)
        line += (
            f"  capture {capture * 1e6:>7.0f} us  HTTP scrape {scrape * 1000:>8.2f} ms"
            f"  loop stall max {stall * 1000:>6.2f} ms"
        )
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--vbuckets", type=int, default=32, help="per stream, per-stream case")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"best of {args.repeat}; scrape: median over HTTP/1.1 keep-alive, gzip\n")
    report("baseline: empty registry", None, False, args.repeat)
    report("baseline: gateway, no streams", GatewayStats(), False, args.repeat)
    report(
        f"{args.streams} streams x {args.vbuckets} vbuckets",
        populate(args.streams, args.vbuckets), False, args.repeat,
    )  # fmt: skip
    report("100 streams x 64 vbuckets, per-vbucket on", populate(100, 64), True, args.repeat)


if __name__ == "__main__":
    main()
