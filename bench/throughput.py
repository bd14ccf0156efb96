"""Throughput and added latency of the fronts, each beside a byte relay on the same upstream.

The upstream is an in-memory producer serving pre-encoded streams (see
``inmem.py``), so each figure isolates the gateway: the same reader reads the
same items once through a plain trio byte relay and once through the
gateway, alternately, best of ``--runs`` runs each.

    python bench/throughput.py [--items 400000] [--vbuckets 64] [--runs 2]
        [--large-items 50000] [--rates 2000,20000] [--capacity 10000,5000]
        [--upr-max-rates 2000,5000,10000,20000,40000] [--only tap-backfill,...]

Prints one table: path, items/s (and MB/s), the relay's, and the ratio (the
UPR front also with 10 consumers reading the log at once, beside 10 TAP
readers through the relay); then the live latency over the relay
(p50/p99/p99.9) at each rate, for the TAP front (one-item UPR snapshots) and
the UPR front (one-item TAP checkpoints), the highest one-item-snapshot rate
the TAP front keeps up with (``tap-capacity``) and the highest live rate the
UPR front sustains. Each gateway logs its largest trio loop stall on exit.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial

import trio

sys.path.insert(0, os.path.dirname(__file__))

from readers import tap_read, upr_read

from gateway.io.connection import PacketConnection as McbpClient

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@contextmanager
def process(command: list[str], pattern: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Run ``command``; yield it with the port its log line matching ``pattern`` names."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
    proc = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            found = re.search(pattern, line)
            if found:
                yield proc, int(found.group(1))
                break
        else:
            raise SystemExit(f"{' '.join(command)} did not start")
    finally:
        proc.terminate()
        assert proc.stderr is not None
        for line in proc.stderr:  # read to the end: the gateway's summary of its loop
            if "trio loop" in line:
                print(f"  {'':<44} {line.split('trio loop', 1)[1].strip(': ')}", end="")
            elif "ack window" in line and "together" not in line:  # did the TAP source wait?
                print(f"  {'':<44} {line}", end="")
        proc.wait(timeout=30)


def upr_source(items: int, value_size: int, vbuckets: int, rate: float = 0.0):  # type: ignore[no-untyped-def]
    command = [sys.executable, os.path.join(HERE, "inmem.py"), str(items), str(value_size),
               str(vbuckets), str(rate)]  # fmt: skip
    return process(command, r"upr source on (\d+)")


def relay(target: int):  # type: ignore[no-untyped-def]
    code = f"import trio, inmem; trio.run(inmem.relay_main, {target})"
    return process([sys.executable, "-c", code], r"relay on (\d+)")


def gateway_tap_front(upstream: int):  # type: ignore[no-untyped-def]
    command = [
        sys.executable, "-m", "gateway", "serve", "--upr-upstream", f"127.0.0.1:{upstream}",
        "--tap-listen", "127.0.0.1:0", "--no-metrics",
    ]  # fmt: skip
    return process(command, r"TAP front listening on 127\.0\.0\.1:(\d+)")


def tap_source(items: int, value_size: int, vbuckets: int, rate: float = 0.0):  # type: ignore[no-untyped-def]
    command = [sys.executable, os.path.join(HERE, "inmem.py"), "tap", str(items),
               str(value_size), str(vbuckets), str(rate)]  # fmt: skip
    return process(command, r"tap source on (\d+)")


UPR_FSYNC = ["batch"]
"""The UPR front's ``--fsync`` policy in these runs (``--upr-fsync``)."""


NO_DIRECT_WRITES = """
import runpy
from gateway.io import connection
init = connection.PacketConnection.__init__
def no_direct(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self._direct = False
connection.PacketConnection.__init__ = no_direct
runpy.run_module("gateway", run_name="__main__", alter_sys=True)
"""
"""The gateway with ``PacketConnection``'s direct writes off (``BENCH_DIRECT=0``)."""


def gateway_upr_front(upstream: int, state_dir: str):  # type: ignore[no-untyped-def]
    profile = os.environ.get("BENCH_PROFILE")  # a file: the UPR front's run under cProfile
    if os.environ.get("BENCH_DIRECT") == "0":  # every send queued for the writer task
        start = ["-c", NO_DIRECT_WRITES]
    elif wrapper := os.environ.get("BENCH_WRAPPER"):  # a script that runs the gateway
        start = [wrapper]
    else:
        start = [*(["-m", "cProfile", "-o", profile] if profile else []), "-m", "gateway"]
    command = [
        sys.executable, *start,
        "serve", "--tap-upstream", f"127.0.0.1:{upstream}",
        "--upr-listen", "127.0.0.1:0", "--state-dir", state_dir, "--no-metrics",
        "--fsync", UPR_FSYNC[0],
    ]  # fmt: skip
    return process(command, r"UPR front listening on 127\.0\.0\.1:(\d+)")


def upr_front(items: int, vbuckets: int, runs: int) -> None:
    """A consumer reading while the gateway ingests, then a second one from the log."""
    highs = {vb: items // vbuckets + (vb < items % vbuckets) for vb in range(vbuckets)}
    via_relay: list[tuple[int, int, float]] = []
    ingest: list[tuple[int, int, float]] = []
    from_log: list[tuple[int, int, float]] = []
    together: list[tuple[int, int, float]] = []
    relay_together: list[tuple[int, int, float]] = []
    with tap_source(items, 100, vbuckets) as (_, source), relay(source) as (_, relay_port):
        for run in range(runs):
            via_relay.append(
                trio.run(
                    partial(tap_read, relay_port, name=b"relay%d" % run, dump=False, expected=items)
                )
            )
            with (
                tempfile.TemporaryDirectory() as state,
                gateway_upr_front(source, state) as (gateway, port),
            ):
                trio.run(until_serving, port, vbuckets)
                before, loop_before = cpu_seconds(gateway.pid), loop_cpu_seconds(gateway.pid)
                ingest.append(trio.run(partial(upr_read, port, highs, name=b"ingest")))
                middle, loop = cpu_seconds(gateway.pid), loop_cpu_seconds(gateway.pid) - loop_before
                from_log.append(trio.run(partial(upr_read, port, highs, name=b"log")))
                after = cpu_seconds(gateway.pid)
                together.append(upr_read_together(port, highs, CONSUMERS))
                cpu = (middle - before, after - middle, cpu_seconds(gateway.pid) - after)
            relay_together.append(tap_read_together(relay_port, items, CONSUMERS, run))
    row("UPR front, consumer while ingesting", best(ingest), best(via_relay))
    print(
        f"  {'':<44} gateway CPU {cpu[0] / items * 1e6:.1f} us/item (last run), "
        f"{loop / items * 1e6:.1f} of it on the trio loop's thread"
    )
    row("UPR front, from the log, 1 consumer", best(from_log), best(via_relay))
    print(f"  {'':<44} gateway CPU {cpu[1] / items * 1e6:.1f} us/item (last run)")
    row(f"UPR front, from the log, {CONSUMERS} consumers", best(together), best(relay_together))
    print(
        f"  {'':<44} gateway CPU {cpu[2] / items / CONSUMERS * 1e6:.1f} us/item (last run); "
        f"{best(together)[0] / best(together)[2] / (best(from_log)[0] / best(from_log)[2]):.2f}"
        " x the 1-consumer items/s"
    )


CONSUMERS = 10


async def until_serving(port: int, vbuckets: int) -> None:
    """Until the UPR front has a log for every vbucket: it opens them once its TAP
    upstream named them, and a STREAM_REQ before then gets NOT_MY_VBUCKET."""
    while True:
        client = await McbpClient.connect("127.0.0.1", port, name="bench")
        async with client:
            seqnos = await client.stats("vbucket-seqno")
        if sum(1 for key in seqnos if key.endswith(":high_seqno")) >= vbuckets:
            return
        await trio.sleep(0.05)


Read = Callable[[], Awaitable[tuple[int, int, float]]]


def _timed(read: Read) -> tuple[int, int, float, float]:
    """(items, bytes, start, end) of one reader run in a process of its own."""
    started = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    count, size, _ = trio.run(read)
    return count, size, started, time.perf_counter()


def run_together(reads: list[Read]) -> tuple[int, int, float]:
    """Readers at once, each in a process of its own (one process would cap them all
    at one core): (items, bytes) of all, and seconds from the first start to the last end."""
    with multiprocessing.get_context("fork").Pool(len(reads)) as pool:
        results = pool.map(_timed, reads)
    first = min(r[2] for r in results)
    last = max(r[3] for r in results)
    return sum(r[0] for r in results), sum(r[1] for r in results), last - first


def upr_read_together(port: int, highs: dict[int, int], n: int) -> tuple[int, int, float]:
    """``n`` UPR consumers reading every vbucket at once."""
    return run_together([partial(upr_read, port, highs, name=b"together%d" % i) for i in range(n)])


def tap_read_together(port: int, items: int, n: int, run: int) -> tuple[int, int, float]:
    """``n`` TAP readers of the whole stream through the relay at once."""
    names = [b"relay-together%d-%d" % (run, i) for i in range(n)]
    return run_together(
        [partial(tap_read, port, name=name, dump=False, expected=items) for name in names]
    )


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_cpu_seconds(pid: int) -> float:
    """CPU of the process's main thread (the gateway's trio loop: fsyncs and disk reads
    run in other threads), which caps what one gateway process serves."""
    with open(f"/proc/{pid}/task/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ROWS: list[tuple[str, float, float, float, float]] = []


def row(label: str, gateway: tuple[int, int, float], relay: tuple[int, int, float]) -> None:
    g_rate, r_rate = gateway[0] / gateway[2], relay[0] / relay[2]
    ROWS.append((label, g_rate, gateway[1] / gateway[2] / 1e6, r_rate, relay[1] / relay[2] / 1e6))
    print(
        f"  {label:<44} {g_rate:>10,.0f} items/s {gateway[1] / gateway[2] / 1e6:7.1f} MB/s | "
        f"relay {r_rate:>10,.0f} items/s {relay[1] / relay[2] / 1e6:7.1f} MB/s | "
        f"ratio {g_rate / r_rate:.2f}",
        flush=True,
    )


def best(results: list[tuple[int, int, float]]) -> tuple[int, int, float]:
    return max(results, key=lambda r: r[0] / r[2])


def tap_backfill(items: int, value_size: int, vbuckets: int, runs: int) -> None:
    label = f"TAP front, backfill+dump, support-ack, {value_size} B"
    with (
        upr_source(items, value_size, vbuckets) as (_, source),
        relay(source) as (_, relay_port),
        gateway_tap_front(source) as (gateway, tap_port),
    ):
        highs = {vb: items // vbuckets + (vb < items % vbuckets) for vb in range(vbuckets)}
        via_relay, via_gateway = [], []
        cpu = 0.0
        for run in range(runs):
            via_relay.append(trio.run(partial(upr_read, relay_port, highs, name=b"relay")))
            before = cpu_seconds(gateway.pid)
            result = trio.run(partial(tap_read, tap_port, name=b"bench%d" % run, dump=True))
            cpu = cpu_seconds(gateway.pid) - before
            via_gateway.append(result)
            for got in (via_relay[-1][0], result[0]):
                if got != items:
                    print(f"  warning: {got} items read, {items} expected")
        row(label, best(via_gateway), best(via_relay))
        print(f"  {'':<44} gateway CPU {cpu / items * 1e6:.1f} us/item (last run)")


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(samples, n=1000)
    return cuts[499], cuts[989], cuts[998]


def tap_live(rate: float, vbuckets: int, seconds: float) -> tuple[bool, bool] | None:
    """One-item snapshots at ``rate`` items/s, read live through the TAP front and the relay;
    whether each kept up (every item, and a p99 within ``KEPT_UP`` of the feed), or
    None without enough samples. Each reader runs in a process of its own, as
    ``upr_live``'s do: at 20k items/s the TAP reader alone decodes 60k messages and
    sends 40k acks a second, and one process reading both sides delayed both."""
    expected = int(rate * seconds)
    with (
        upr_source(0, 100, vbuckets, rate) as (source_proc, source),
        relay(source) as (_, relay_port),
        gateway_tap_front(source) as (gateway, tap_port),
    ):
        highs = {vb: 0 for vb in range(vbuckets)}
        # With the CHECKPOINT flag: one checkpoint per item, three messages, the worst case.
        gateway_side = partial(
            tap_read, tap_port, name=b"live", dump=False, expected=expected, checkpoint=True
        )
        relay_side = partial(
            upr_read, relay_port, highs, name=b"relay", live=True, expected=expected
        )
        cpu_before = cpu_seconds(gateway.pid)
        started = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(2) as pool:
            readers = [
                pool.apply_async(_live_reader, (partial(_latencies_into, side), seconds + 15))
                for side in (gateway_side, relay_side)
            ]
            time.sleep(1.0)  # both streams requested
            assert source_proc.stdin is not None
            source_proc.stdin.write(f"go\n{expected}\n")
            source_proc.stdin.flush()
            via_gateway, via_relay = (r.get() for r in readers)
        cpu = cpu_seconds(gateway.pid) - cpu_before
        got_gateway, got_relay = len(via_gateway), len(via_relay)
        elapsed = time.perf_counter() - started
        if len(via_gateway) < 10 or len(via_relay) < 10:
            print(f"  live {rate:,.0f}/s: too few samples ({len(via_gateway)}, {len(via_relay)})")
            return None
        g, r = quantiles(via_gateway), quantiles(via_relay)
        print(
            f"  TAP front live (CHECKPOINT flag) {rate:>7,.0f}/s: got {got_gateway:,}/{expected:,} "
            f"(relay {got_relay:,}) in {elapsed:.1f}s; added p50 {(g[0] - r[0]) * 1e3:+.2f} ms, "
            f"p99 {(g[1] - r[1]) * 1e3:+.2f} ms, p99.9 {(g[2] - r[2]) * 1e3:+.2f} ms "
            f"(relay p50 {r[0] * 1e3:.2f} p99 {r[1] * 1e3:.2f} ms); "
            f"gateway CPU {cpu / max(1, got_gateway) * 1e6:.1f} us/item",
            flush=True,
        )
        return (
            got_gateway >= expected and g[0] - r[0] < KEPT_UP,
            got_relay >= expected and r[0] < KEPT_UP,
        )


KEPT_UP = 0.05
"""A live reader keeps up when every item arrives and the median latency (for the
front: added over the relay) stays under 50 ms; one that falls behind sees it grow
with the run, to seconds."""


def tap_capacity(vbuckets: int, seconds: float, start: float, step: float) -> None:
    """The highest one-item-snapshot rate the TAP front keeps up with: rates from
    ``start`` going up by ``step`` until the front (or the relay) falls behind."""
    rate, sustained = start, 0.0
    while True:
        kept = tap_live(rate, vbuckets, seconds)
        if kept is None or not kept[0]:
            break
        sustained = rate
        if not kept[1]:
            print(f"  the relay fell behind at {rate:,.0f}/s: the front kept up to there at least")
            break
        rate += step
    print(f"  TAP front sustains {sustained:,.0f} items/s (one snapshot per item)", flush=True)


def _live_reader(read: Callable[[list[float]], Awaitable[object]], limit: float) -> list[float]:
    """The latencies one live reader records, in a process of its own."""
    latencies: list[float] = []

    async def bounded() -> None:
        with trio.move_on_after(limit):
            await read(latencies)

    trio.run(bounded)
    return latencies


def upr_live(rate: float, vbuckets: int, seconds: float) -> bool:
    """One-item checkpoints at ``rate`` items/s from a TAP producer, read live as UPR
    through the UPR front and as TAP through the relay; whether the front kept up
    (every item arrived, the added p50 under ``KEEP_UP_P50``). Each reader runs in a
    process of its own: at 20k items/s one process reading both sides (60k TAP
    messages and their acks, 40k UPR messages a second) fell behind by itself."""
    expected = int(rate * seconds)
    with (
        tap_source(0, 100, vbuckets, rate) as (source_proc, source),
        relay(source) as (_, relay_port),
        tempfile.TemporaryDirectory() as state,
        gateway_upr_front(source, state) as (gateway, port),
    ):
        highs = {vb: 0 for vb in range(vbuckets)}
        trio.run(until_serving, port, vbuckets)
        gateway_side = partial(upr_read, port, highs, name=b"live", live=True, expected=expected)
        relay_side = partial(tap_read, relay_port, name=b"relay", dump=False, expected=expected)
        cpu_before = cpu_seconds(gateway.pid)
        started = time.perf_counter()
        with multiprocessing.get_context("fork").Pool(2) as pool:
            readers = [
                pool.apply_async(_live_reader, (partial(_latencies_into, side), seconds + 15))
                for side in (gateway_side, relay_side)
            ]
            time.sleep(1.5)  # both streams requested
            assert source_proc.stdin is not None
            source_proc.stdin.write(f"go\n{expected}\n")
            source_proc.stdin.flush()
            via_gateway, via_relay = (r.get() for r in readers)
        elapsed = time.perf_counter() - started
        cpu = cpu_seconds(gateway.pid) - cpu_before
        got_gateway, got_relay = len(via_gateway), len(via_relay)
        if got_gateway < 10 or got_relay < 10:
            print(f"  UPR front live {rate:,.0f}/s: too few samples ({got_gateway}, {got_relay})")
            return False
        g, r = quantiles(via_gateway), quantiles(via_relay)
        print(
            f"  UPR front live {rate:>7,.0f}/s: got {got_gateway:,}/{expected:,} "
            f"(relay {got_relay:,}) in {elapsed:.1f}s; added p50 {(g[0] - r[0]) * 1e3:+.2f} ms, "
            f"p99 {(g[1] - r[1]) * 1e3:+.2f} ms, p99.9 {(g[2] - r[2]) * 1e3:+.2f} ms "
            f"(relay p50 {r[0] * 1e3:.2f} p99 {r[1] * 1e3:.2f} ms); "
            f"gateway CPU {cpu / max(1, got_gateway) * 1e6:.1f} us/item",
            flush=True,
        )
        return got_gateway >= expected and g[0] - r[0] < KEEP_UP_P50


async def _latencies_into(read: Callable[..., Awaitable[object]], latencies: list[float]) -> None:
    await read(latencies=latencies)


KEEP_UP_P50 = 0.01
"""A live rate is sustained when every item arrives and the added p50 stays under
this (seconds): a front that falls behind adds ever more."""


def upr_live_highest(vbuckets: int, seconds: float, rates: list[float]) -> None:
    """The highest of ``rates`` (ascending) the UPR front sustains."""
    best_rate = 0.0
    for rate in rates:
        if not upr_live(rate, vbuckets, seconds):
            break
        best_rate = rate
    print(f"  UPR front live: highest rate sustained {best_rate:,.0f} items/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=400_000)
    parser.add_argument("--large-items", type=int, default=50_000, help="items of 4 KB")
    parser.add_argument("--vbuckets", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rates", default="2000,20000")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--capacity", default="10000,5000", help="start,step of tap-capacity")
    parser.add_argument(
        "--upr-max-rates",
        default="2000,5000,10000,20000,40000",
        help="rates tried in turn for the UPR front's highest live rate",
    )
    parser.add_argument(
        "--upr-fsync",
        default="batch",
        choices=("always", "batch", "never"),
        help="the UPR front's --fsync policy (never: what it adds without waiting for the disk)",
    )
    parser.add_argument(
        "--only", default="tap-backfill,tap-large,upr,tap-live,tap-capacity,upr-live,upr-live-max"
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    UPR_FSYNC[0] = args.upr_fsync
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    if "tap-backfill" in only:
        tap_backfill(args.items, 100, args.vbuckets, args.runs)
    if "tap-large" in only:
        tap_backfill(args.large_items, 4096, args.vbuckets, args.runs)
    if "upr" in only:
        upr_front(args.items, args.vbuckets, args.runs)
    if "tap-live" in only:
        for rate in args.rates.split(","):
            tap_live(float(rate), args.vbuckets, args.seconds)
    if "tap-capacity" in only:
        start, step = (float(x) for x in args.capacity.split(","))
        tap_capacity(args.vbuckets, args.seconds, start, step)
    if "upr-live" in only:
        for rate in args.rates.split(","):
            upr_live(float(rate), args.vbuckets, args.seconds)
    if "upr-live-max" in only:
        rates = [float(r) for r in args.upr_max_rates.split(",")]
        upr_live_highest(args.vbuckets, args.seconds, rates)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
