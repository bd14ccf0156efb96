"""A real Prometheus scrapes serve_metrics while the stats change.

The test plays the fronts: a driver task moves two streams (one per
direction) as live traffic would, then stops and resumes acknowledging.
Prometheus (the Debian package's binary, on a loopback port, scraping every
0.5 s) must scrape the endpoint, answer every PromQL expression of the
Grafana dashboard with data, and see the lag rise and fall.

About 5 s of the run is Prometheus itself: its discovery manager hands new
targets to the scrape manager on a fixed 5 s tick, so the first scrape
cannot come sooner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from functools import partial

import trio

from gateway.metrics import serve_metrics
from gateway.metrics.figures import TAP_FRONT, UPR_FRONT, GatewayStats, StreamStats
from tests.support.prometheus import (
    Prometheus,
    Result,
    dashboard_queries,
    grafana_substitute,
    values,
)

TICK = 0.05
VBUCKETS = 8


class Traffic:
    """Moves the stats as the fronts would under a steady write load."""

    def __init__(self, stats: GatewayStats) -> None:
        self.stats = stats
        self.acking = True
        self.tap = StreamStats(TAP_FRONT, "replica-1", "upr-node:11210", created=time.time())
        self.upr = StreamStats(UPR_FRONT, "xdcr", "tap-node:11210", created=time.time())
        for stream in (self.tap, self.upr):
            stream.buffer_size = 1 << 20
            for vb in range(VBUCKETS):
                stream.vbucket(vb)
        self.tap.ack_window = 64
        self.tap.vbucket(7).backfilling = True
        self.tap.vbucket(7).backfill_end_seqno = 1_000_000
        stats.upstream_reconnects_total["upr-node:11210"] += 1
        stats.rollbacks_total[UPR_FRONT] += 1
        stats.last_rollback_seqno[UPR_FRONT] = 17
        stats.protocol_errors_total[TAP_FRONT, "malformed"] += 1
        stats.stream_ends_total[UPR_FRONT, "closed"] += 1
        stats.upr_log.bytes_on_disk = 4096
        stats.upr_log.failover_log_lengths.update({0: 1, 1: 2})

    def tick(self, n: int) -> None:
        now = time.time()
        for stream in (self.tap, self.upr):
            for vb in range(VBUCKETS):
                p = stream.vbucket(vb)
                p.upstream_high_seqno += 5
                p.sent_seqno = p.upstream_high_seqno
                if self.acking:
                    p.acked_seqno = p.sent_seqno
            stream.items_sent["mutation"] += 4 * VBUCKETS
            stream.items_sent["deletion"] += VBUCKETS
            stream.items_sent["marker"] += 1
            stream.items_sent["state"] += n % 2
            stream.bytes_sent += 4000
            stream.last_item_time = now
            stream.unacked_bytes = 0 if self.acking else min(stream.unacked_bytes + 4000, 1 << 20)
            stream.blocked_seconds += 0 if self.acking else TICK
            if self.acking:
                stream.oldest_unacked_time = None
                stream.latency.observe(0.002 + (n % 10) / 1000)
            elif stream.oldest_unacked_time is None:
                stream.oldest_unacked_time = now
        self.tap.acks_pending = 0 if self.acking else 64
        self.tap.nacks_total += n % 3 == 0
        self.tap.retransmits_total += n % 3 == 0
        self.stats.protocol_errors_total[TAP_FRONT, "malformed"] += n % 20 == 0
        self.stats.stream_ends_total[UPR_FRONT, "closed"] += n % 20 == 0
        self.stats.upr_log.bytes_on_disk += 100
        self.stats.upr_log.compactions_total += n % 40 == 0

    async def run(self) -> None:
        with self.stats.stream(self.tap), self.stats.stream(self.upr):
            n = 0
            while True:
                self.tick(n)
                n += 1
                await trio.sleep(TICK)


def nonempty(result: Result) -> bool:
    return len(result) > 0


async def test_prometheus_scrapes_dashboard_and_sees_lag_rise_and_fall(
    nursery: trio.Nursery,
    prometheus_factory: Callable[..., AbstractAsyncContextManager[Prometheus]],
) -> None:
    stats = GatewayStats()
    traffic = Traffic(stats)
    nursery.start_soon(traffic.run)
    port = await nursery.start(partial(serve_metrics, stats, "127.0.0.1", 0, per_vbucket=True))
    async with prometheus_factory([f"127.0.0.1:{port}"]) as prom:
        await prom.wait_for('up{job="tapupr"} == 1', nonempty)
        # Enough samples for rate() over the 5 s windows the dashboard gets here.
        await prom.wait_for(
            "count_over_time(tapupr_active_connections[5s]) >= 3", lambda r: len(r) == 2
        )

        queries = dashboard_queries()
        assert len(queries) > 30
        for query in queries:
            expr = grafana_substitute(query.expr)
            result = await prom.wait_for(expr, nonempty, timeout=10)  # parse errors raise
            if query.label is not None:
                assert all(query.label in sample["metric"] for sample in result), query

        lag = 'tapupr_stream_ack_lag_seqnos{connection="replica-1"}'
        age = 'tapupr_stream_ack_lag_seconds{connection="replica-1"}'
        # Rendering reads the stats from a worker thread while ticks run, so one
        # scrape may land mid-tick: wait for the steady value rather than assert one.
        await prom.wait_for(lag, lambda r: values(r) == [0])

        traffic.acking = False
        await prom.wait_for(lag, lambda r: values(r)[0] >= 5 * VBUCKETS * 4)
        await prom.wait_for(age, lambda r: values(r)[0] > 0)
        rising = values(await prom.query(lag))[0]
        await prom.wait_for(lag, lambda r: values(r)[0] > rising)
        await prom.wait_for(
            'tapupr_stream_tap_acks_pending{connection="replica-1"}', lambda r: values(r) == [64]
        )

        traffic.acking = True
        await prom.wait_for(lag, lambda r: values(r) == [0])
        await prom.wait_for(age, lambda r: values(r) == [0])
    nursery.cancel_scope.cancel()
