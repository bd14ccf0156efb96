"""Fixtures of the metrics tests: fresh stats and registry, a scrape parser, Prometheus.

``prometheus_factory`` starts a real Prometheus (``tests/support/prometheus.py``)
scraping given targets; tests of the fronts can use it the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics.figures import ITEM_KINDS, TAP_FRONT, UPR_FRONT, GatewayStats, StreamStats
from tests.support.prometheus import MISSING, PROMETHEUS, Prometheus, run_prometheus

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

NOW = 1_700_000_000.0


class Clock:
    """A settable wall clock for the collector."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = sample.value
    return out


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no series {name}{labels}; have {sorted(k for k, _ in samples)[:50]}"
    return samples[key]


@pytest.fixture
def stats() -> GatewayStats:
    return GatewayStats()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def open_stream(stats: GatewayStats) -> Iterator[Callable[..., StreamStats]]:
    """Register streams as a front does (``with stats.stream(...)``), closed at the end."""
    opened: list[AbstractContextManager[StreamStats]] = []

    def open_(direction: str, connection: str, upstream: str = "node:11210") -> StreamStats:
        stream = StreamStats(direction, connection, upstream, created=NOW - 60)
        cm = stats.stream(stream)
        cm.__enter__()
        opened.append(cm)
        return stream

    yield open_
    for cm in reversed(opened):
        cm.__exit__(None, None, None)


@pytest.fixture
def prometheus_factory() -> Callable[..., AbstractAsyncContextManager[Prometheus]]:
    """``async with prometheus_factory(["127.0.0.1:PORT"]) as prom:`` a real Prometheus."""
    if PROMETHEUS is None:
        pytest.skip(MISSING)
    return run_prometheus


def busy_stats() -> GatewayStats:
    """Every family with samples in it: streams of both directions, every counter moved."""
    stats = GatewayStats()
    for direction, name in ((TAP_FRONT, "replica-1"), (UPR_FRONT, "xdcr"), (UPR_FRONT, "fts")):
        stream = StreamStats(direction, name, "node:11210", created=1.7e9)
        stats.streams[id(stream)] = stream
        stats.connections_total[direction] += 1
        for kind in ITEM_KINDS:
            stream.items_sent[kind] += 3
        stream.bytes_sent, stream.last_item_time = 100, 1.7e9 + 5
        stream.oldest_unacked_time = 1.7e9
        stream.buffer_size, stream.unacked_bytes, stream.blocked_seconds = 1000, 10, 0.5
        stream.acks_pending, stream.ack_window, stream.nacks_total = 2, 10, 1
        stream.latency.observe(0.01)
        for vb in range(4):
            p = stream.vbucket(vb)
            p.upstream_high_seqno, p.sent_seqno, p.acked_seqno = 10, 8, 6
            p.backfilling, p.backfill_end_seqno = vb == 0, 9
    stats.upstream_reconnects_total["node:11210"] += 1
    stats.rollbacks_total[UPR_FRONT] += 1
    stats.last_rollback_seqno[UPR_FRONT] = 5
    stats.stream_ends_total[UPR_FRONT, "closed"] += 1
    stats.protocol_errors_total[TAP_FRONT, "malformed"] += 1
    stats.takeovers_started_total[TAP_FRONT] += 1
    stats.upr_log.failover_log_lengths[0] = 2
    return stats
