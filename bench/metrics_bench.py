"""/metrics render time: 1,000 streams, and per-vbucket series for 100 streams x 64 vbuckets.

Baselines measured in the same run: rendering an empty registry (the fixed
cost of the exposition code) and a gateway with no streams. For each case:

- client encoder: ``prometheus_client.generate_latest`` over a registry
  holding the gateway's collector (what a caller of
  ``register_gateway_metrics`` gets);
- direct: capture plus ``gateway.metrics.render``, text and OpenMetrics
  (what ``serve_metrics`` does, in a worker thread);
- capture on loop: the part of a scrape that runs on the trio thread;
- HTTP scrape: a full GET of ``serve_metrics`` over loopback (gzip,
  Prometheus' Accept header), median, with the longest stall a 1 ms ticker
  on the trio loop saw meanwhile (GIL hand-offs and garbage collection).

Then the cost to the streams of being scraped: the UPR front's ingest-and-serve
throughput (``upr_front_bench``: N items from a reference TAP node to 10
consumers) with no metrics endpoint, and with ``serve_metrics`` on its stats
scraped every 100 ms (150x a common 15 s interval), alternating runs. And the
same for the TAP front, with the node and the gateway in processes of their own
as ``tap_front_bench`` runs them: a TAP dump of N 100-byte items through
``serve --upr-upstream --no-metrics``, beside a second gateway over the same
node with ``--metrics-listen``, not scraped and scraped every 100 ms by a
process of its own (as Prometheus would), alternating runs.

    python bench/metrics_bench.py [--streams N] [--vbuckets V] [--repeat R]
        [--front-items N] [--tap-front-items N]
"""

from __future__ import annotations

import argparse
import gzip
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

import trio
from prometheus_client import CollectorRegistry, generate_latest

from gateway.metrics import register_gateway_metrics, serve_metrics
from gateway.metrics.collector import GatewayCollector
from gateway.metrics.families import gateway_families
from gateway.metrics.figures import ITEM_KINDS, TAP_FRONT, UPR_FRONT, GatewayStats, StreamStats
from gateway.metrics.render import render

PROMETHEUS_ACCEPT = (
    b"application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    b"q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
"""What Prometheus 2.x sends: the scrape is rendered as OpenMetrics."""


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
        request = (
            b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept-Encoding: gzip\r\n"
            b"Accept: " + PROMETHEUS_ACCEPT + b"\r\n\r\n"
        )
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
    if stats is None:
        text = generate_latest(registry)
        client = best(lambda: generate_latest(registry), repeat)
        print(f"{label:<44} {0:>7} series  client encoder {client * 1000:>7.2f} ms", flush=True)
        return
    register_gateway_metrics(registry, stats, per_vbucket=per_vbucket)
    collector = GatewayCollector(stats, per_vbucket=per_vbucket)
    text = generate_latest(registry)
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    client = best(lambda: generate_latest(registry), repeat)

    def direct(openmetrics: bool) -> bytes:
        view = collector.capture()
        return render(gateway_families(view, per_vbucket=per_vbucket), openmetrics=openmetrics)

    direct_text = best(lambda: direct(False), repeat)
    direct_om = best(lambda: direct(True), repeat)
    capture = best(collector.capture, repeat)
    scrape, stall = trio.run(http_scrape, stats, per_vbucket, repeat)
    print(
        f"{label:<44} {series:>7} series {len(text) / 1024:>6.0f} KiB"
        f" ({len(gzip.compress(text, 1)) / 1024:>4.0f} gz)"
        f"  client encoder {client * 1000:>7.2f} ms"
        f"  direct text {direct_text * 1000:>7.2f} ms  openmetrics {direct_om * 1000:>7.2f} ms"
        f"  capture on loop {capture * 1e6:>4.0f} us"
        f"  HTTP scrape {scrape * 1000:>7.2f} ms  loop stall max {stall * 1000:>5.1f} ms",
        flush=True,
    )


async def scraper(port: int, every: float, count: list[int]) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    request = (
        b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept-Encoding: gzip\r\n"
        b"Accept: " + PROMETHEUS_ACCEPT + b"\r\n\r\n"
    )
    while True:
        await trio.sleep(every)
        await stream.send_all(request)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += await stream.receive_some(1 << 20)
        head, _, body = buffer.partition(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += await stream.receive_some(1 << 20)
        count[0] += 1


async def upr_front_run(
    items: int, consumers: int, scrape_every: float | None
) -> tuple[float, int]:
    """(items per second through the UPR front, scrapes done meanwhile)."""
    import tempfile
    from pathlib import Path

    from upr_front_bench import VBUCKETS, consume, start_front, start_node

    from gateway.node.store import Store

    store = Store(VBUCKETS, max_items=items * 2)
    written = store.populate_sample(items, value_size=100, now=time.time())
    scrapes = [0]
    with tempfile.TemporaryDirectory() as tmp:
        async with trio.open_nursery() as nursery:
            node_port = await start_node(nursery, store)
            started = time.perf_counter()
            front = await start_front(nursery, node_port, Path(tmp))
            if scrape_every is not None:
                port = await nursery.start(partial(serve_metrics, front.stats, "127.0.0.1", 0))
                nursery.start_soon(scraper, port, scrape_every, scrapes)
            async with trio.open_nursery() as readers:
                for i in range(consumers):
                    readers.start_soon(consume, front.port, b"bench-%d" % i, written)
            elapsed = time.perf_counter() - started
            nursery.cancel_scope.cancel()
    return written / elapsed, scrapes[0]


def front_overhead(items: int, rounds: int = 4) -> None:
    off: list[float] = []
    on: list[float] = []
    scrapes = 0
    for _ in range(rounds):  # alternate, so drift on a shared machine hits both alike
        off.append(trio.run(upr_front_run, items, 10, None)[0])
        rate, done = trio.run(upr_front_run, items, 10, 0.1)
        on.append(rate)
        scrapes += done
    med_off, med_on = statistics.median(off), statistics.median(on)
    print(
        f"\nUPR front, {items} items to 10 consumers, median of {rounds} alternating runs:\n"
        f"  metrics off           {med_off:>9,.0f} items/s"
        f"  (runs {min(off):,.0f} .. {max(off):,.0f})\n"
        f"  scraped every 100 ms  {med_on:>9,.0f} items/s"
        f"  (runs {min(on):,.0f} .. {max(on):,.0f}; {scrapes} scrapes)\n"
        f"  ratio on/off {med_on / med_off:.3f}",
        flush=True,
    )


@contextmanager
def gateway_process(node_port: int, metrics: bool) -> Iterator[tuple[int, int | None]]:
    """``serve --upr-upstream`` in a process of its own: (TAP port, metrics port or None)."""
    command = [
        sys.executable, "-m", "gateway", "serve", "--upr-upstream", f"127.0.0.1:{node_port}",
        "--tap-listen", "127.0.0.1:0",
        *(["--metrics-listen", "127.0.0.1:0"] if metrics else ["--no-metrics"]),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        tap_port: int | None = None
        metrics_port: int | None = None
        for line in proc.stderr:
            if found := re.search(r"TAP front listening on 127\.0\.0\.1:(\d+)", line):
                tap_port = int(found.group(1))
            if found := re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", line):
                metrics_port = int(found.group(1))
            if tap_port is not None and (metrics_port is not None or not metrics):
                break
        else:
            raise SystemExit(f"the gateway did not start (exit {proc.wait()})")
        # Keep reading its log so a full pipe never stalls it.
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield tap_port, metrics_port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def scrape_forever(port: int, every: float) -> None:
    """A scraper for a child process: one ``.`` on stdout per scrape, until terminated."""
    count = [0]
    print("ready", flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scraper, port, every, count)
        shown = 0
        while True:
            await trio.sleep(every)
            print("." * (count[0] - shown), end="", flush=True)
            shown = count[0]


@contextmanager
def scraper_process(port: int, every: float) -> Iterator[list[int]]:
    """Scrape ``port`` from a process of its own, as Prometheus would; yields [scrapes done]."""
    code = (
        "import sys, trio; sys.path.insert(0, 'bench'); import metrics_bench as m;"
        f"trio.run(m.scrape_forever, {port}, {every})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    done = [0]
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # ready
        yield done
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        done[0] = out.count(".")


def tap_front_run(
    tap_port: int, name: bytes, items: int, scrape_port: int | None
) -> tuple[float, int]:
    """(items per second of one TAP dump, scrapes done meanwhile)."""
    from tap_front_bench import tap_dump

    with ExitStack() as stack:
        scrapes = [0]
        if scrape_port is not None:
            scrapes = stack.enter_context(scraper_process(scrape_port, 0.1))
        count, _, elapsed = trio.run(tap_dump, tap_port, name)
    if count != items:
        raise SystemExit(f"the dump delivered {count} of {items} items")
    return count / elapsed, scrapes[0]


def tap_front_overhead(items: int, rounds: int = 5, vbuckets: int = 64) -> None:
    from tap_front_bench import node_command, process

    rates: dict[str, list[float]] = {"off": [], "idle": [], "scraped": []}
    scrapes = 0
    with ExitStack() as stack:
        _, node_port = stack.enter_context(
            process(node_command(items, 100, vbuckets), r"listening on 127\.0\.0\.1:(\d+)")
        )
        plain, _ = stack.enter_context(gateway_process(node_port, metrics=False))
        with_metrics, metrics_port = stack.enter_context(gateway_process(node_port, metrics=True))
        tap_front_run(plain, b"warm-up", items, None)  # the node's first read of its items
        for n in range(rounds):  # alternate, so drift on a shared machine hits all alike
            rates["off"].append(tap_front_run(plain, b"off-%d" % n, items, None)[0])
            rates["idle"].append(tap_front_run(with_metrics, b"idle-%d" % n, items, None)[0])
            rate, done = tap_front_run(with_metrics, b"on-%d" % n, items, metrics_port)
            rates["scraped"].append(rate)
            scrapes += done
    med = {mode: statistics.median(runs) for mode, runs in rates.items()}
    labels = {
        "off": "--no-metrics",
        "idle": "metrics on, not scraped",
        "scraped": "scraped every 100 ms",
    }
    print(
        f"\nTAP front, dump of {items:,} items of 100 bytes ({vbuckets} vbuckets); node, "
        f"gateways and scraper in processes of their own; median of {rounds} alternating runs:"
    )
    for mode, runs in rates.items():
        extra = f"; {scrapes} scrapes" if mode == "scraped" else ""
        print(
            f"  {labels[mode]:<24} {med[mode]:>9,.0f} items/s"
            f"  (runs {min(runs):,.0f} .. {max(runs):,.0f}{extra})"
        )
    print(
        f"  ratio scraped/off {med['scraped'] / med['off']:.3f}"
        f"  (not scraped/off {med['idle'] / med['off']:.3f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--vbuckets", type=int, default=32, help="per stream, per-stream case")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--front-items", type=int, default=50_000, help="0: skip the front run")
    parser.add_argument(
        "--tap-front-items", type=int, default=200_000, help="0: skip the TAP front run"
    )
    args = parser.parse_args()
    print(f"best of {args.repeat}; scrape: median over HTTP/1.1 keep-alive, gzip\n")
    report("baseline: empty registry", None, False, args.repeat)
    report("baseline: gateway, no streams", GatewayStats(), False, args.repeat)
    report(
        f"{args.streams} streams x {args.vbuckets} vbuckets",
        populate(args.streams, args.vbuckets), False, args.repeat,
    )  # fmt: skip
    report("100 streams x 64 vbuckets, per-vbucket on", populate(100, 64), True, args.repeat)
    if args.front_items:
        front_overhead(args.front_items)
    if args.tap_front_items:
        tap_front_overhead(args.tap_front_items)


if __name__ == "__main__":
    main()
