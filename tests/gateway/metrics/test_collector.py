"""The collector, metric by metric, over a fresh GatewayStats and registry per test.

Each test drives the stats as a front would (attribute updates on
``StreamStats`` registered with ``GatewayStats.stream``) and checks the
series a scrape shows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.registry import Collector

from gateway.metrics import register_gateway_metrics
from gateway.metrics.collector import GatewayCollector
from gateway.metrics.figures import ITEM_KINDS, LATENCY_BUCKETS, TAP_FRONT, UPR_FRONT, GatewayStats
from tests.gateway.metrics.conftest import NOW, Clock, scrape, value

OpenStream = Callable[..., object]
TAP = {"direction": TAP_FRONT, "connection": "replica-1", "upstream": "node:11210"}
UPR = {"direction": UPR_FRONT, "connection": "xdcr", "upstream": "node:11210"}


def setup(stats: GatewayStats, registry: CollectorRegistry, clock: Clock, **kw: bool) -> None:
    register_gateway_metrics(registry, stats, clock=clock, **kw)


def test_empty_gateway_reports_zeroes_per_direction(stats, registry, clock) -> None:
    setup(stats, registry, clock)
    s = scrape(registry)
    for direction in (TAP_FRONT, UPR_FRONT):
        assert value(s, "tapupr_active_connections", direction=direction) == 0
        assert value(s, "tapupr_connections_total", direction=direction) == 0
        assert value(s, "tapupr_rollbacks_total", direction=direction) == 0
        assert value(s, "tapupr_takeovers_started_total", direction=direction) == 0
        for kind in ITEM_KINDS:
            assert value(s, "tapupr_items_sent_total", direction=direction, kind=kind) == 0
    assert value(s, "tapupr_upr_front_log_bytes") == 0
    assert not [k for k in s if k[0].startswith(("tapupr_stream_", "tapupr_vbucket_"))]


def test_items_and_bytes_per_stream_and_in_total(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock)
    tap = open_stream(TAP_FRONT, "replica-1")
    tap.items_sent["mutation"] += 7
    tap.items_sent["deletion"] += 2
    tap.items_sent["marker"] += 4
    tap.bytes_sent += 1234
    s = scrape(registry)
    assert value(s, "tapupr_stream_items_sent_total", **TAP, kind="mutation") == 7
    assert value(s, "tapupr_stream_items_sent_total", **TAP, kind="deletion") == 2
    assert value(s, "tapupr_stream_items_sent_total", **TAP, kind="marker") == 4
    assert value(s, "tapupr_stream_items_sent_total", **TAP, kind="expiration") == 0
    assert value(s, "tapupr_stream_sent_bytes_total", **TAP) == 1234
    assert value(s, "tapupr_items_sent_total", direction=TAP_FRONT, kind="mutation") == 7
    assert value(s, "tapupr_sent_bytes_total", direction=TAP_FRONT) == 1234
    assert value(s, "tapupr_active_connections", direction=TAP_FRONT) == 1


def test_totals_keep_what_closed_connections_sent(stats, registry, clock) -> None:
    from gateway.metrics.figures import StreamStats

    setup(stats, registry, clock)
    with stats.stream(StreamStats(TAP_FRONT, "gone", "node:11210")) as gone:
        gone.items_sent["mutation"] += 5
        gone.bytes_sent += 500
    with stats.stream(StreamStats(TAP_FRONT, "live", "node:11210")) as live:
        live.items_sent["mutation"] += 1
        live.bytes_sent += 100
        s = scrape(registry)
        assert value(s, "tapupr_items_sent_total", direction=TAP_FRONT, kind="mutation") == 6
        assert value(s, "tapupr_sent_bytes_total", direction=TAP_FRONT) == 600
        assert value(s, "tapupr_connections_total", direction=TAP_FRONT) == 2
        assert value(s, "tapupr_active_connections", direction=TAP_FRONT) == 1
        assert not [k for k in s if dict(k[1]).get("connection") == "gone"]
    s = scrape(registry)
    assert value(s, "tapupr_items_sent_total", direction=TAP_FRONT, kind="mutation") == 6
    assert value(s, "tapupr_active_connections", direction=TAP_FRONT) == 0


def test_lag_in_seqnos_against_sent_and_acked(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock)
    stream = open_stream(TAP_FRONT, "replica-1")
    for vb, (high, sent, acked) in {0: (100, 80, 50), 1: (10, 10, 10), 2: (7, 9, 3)}.items():
        p = stream.vbucket(vb)
        p.upstream_high_seqno, p.sent_seqno, p.acked_seqno = high, sent, acked
    s = scrape(registry)
    assert value(s, "tapupr_stream_send_lag_seqnos", **TAP) == 20  # vb 2 ahead counts 0
    assert value(s, "tapupr_stream_ack_lag_seqnos", **TAP) == 50 + 0 + 4
    assert value(s, "tapupr_stream_vbuckets", **TAP) == 3
    stream.vbucket(0).acked_seqno = 100
    stream.vbucket(2).acked_seqno = 7
    s = scrape(registry)
    assert value(s, "tapupr_stream_ack_lag_seqnos", **TAP) == 0
    stream.vbucket(1).upstream_high_seqno = 25  # new writes upstream
    s = scrape(registry)
    assert value(s, "tapupr_stream_send_lag_seqnos", **TAP) == 20 + 15
    assert value(s, "tapupr_stream_ack_lag_seqnos", **TAP) == 15


def test_lag_in_seconds_is_the_age_of_the_oldest_unacked(
    stats, registry, clock, open_stream
) -> None:
    setup(stats, registry, clock)
    stream = open_stream(UPR_FRONT, "xdcr")
    assert value(scrape(registry), "tapupr_stream_ack_lag_seconds", **UPR) == 0
    stream.oldest_unacked_time = NOW - 2.5
    assert value(scrape(registry), "tapupr_stream_ack_lag_seconds", **UPR) == 2.5
    clock.now += 10
    assert value(scrape(registry), "tapupr_stream_ack_lag_seconds", **UPR) == 12.5
    stream.oldest_unacked_time = None
    assert value(scrape(registry), "tapupr_stream_ack_lag_seconds", **UPR) == 0


def test_latency_histogram(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock)
    stream = open_stream(TAP_FRONT, "replica-1")
    for seconds in (0.0004, 0.003, 0.003, 0.2, 100.0):
        stream.latency.observe(seconds)
    s = scrape(registry)
    name = "tapupr_stream_ack_latency_seconds"
    assert value(s, name + "_bucket", **TAP, le="0.0005") == 1
    assert value(s, name + "_bucket", **TAP, le="0.005") == 3
    assert value(s, name + "_bucket", **TAP, le="0.25") == 4
    assert value(s, name + "_bucket", **TAP, le="60.0") == 4
    assert value(s, name + "_bucket", **TAP, le="+Inf") == 5
    assert value(s, name + "_count", **TAP) == 5
    assert value(s, name + "_sum", **TAP) == pytest.approx(100.2064)
    assert sum(1 for k in s if k[0] == name + "_bucket") == len(LATENCY_BUCKETS) + 1


def test_backfill_remaining_and_in_progress(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock)
    stream = open_stream(TAP_FRONT, "replica-1")
    for vb in (0, 1):
        p = stream.vbucket(vb)
        p.backfilling, p.backfill_end_seqno, p.sent_seqno = True, 500, 100
    s = scrape(registry)
    assert value(s, "tapupr_stream_backfill_remaining_items", **TAP) == 800
    assert value(s, "tapupr_stream_backfill_in_progress", **TAP) == 1
    assert value(s, "tapupr_stream_backfilling_vbuckets", **TAP) == 2
    stream.vbucket(0).sent_seqno = 450
    stream.vbucket(1).backfilling = False
    s = scrape(registry)
    assert value(s, "tapupr_stream_backfill_remaining_items", **TAP) == 50
    assert value(s, "tapupr_stream_backfilling_vbuckets", **TAP) == 1
    stream.vbucket(0).backfilling = False
    s = scrape(registry)
    assert value(s, "tapupr_stream_backfill_remaining_items", **TAP) == 0
    assert value(s, "tapupr_stream_backfill_in_progress", **TAP) == 0


def test_flow_control(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock)
    stream = open_stream(UPR_FRONT, "xdcr")
    stream.buffer_size, stream.unacked_bytes = 1 << 20, 4096
    stream.blocked_seconds += 1.25
    s = scrape(registry)
    assert value(s, "tapupr_stream_flow_control_buffer_bytes", **UPR) == 1 << 20
    assert value(s, "tapupr_stream_flow_control_unacked_bytes", **UPR) == 4096
    assert value(s, "tapupr_stream_flow_control_blocked_seconds_total", **UPR) == 1.25
    stream.blocked_seconds += 0.75
    stream.unacked_bytes = 0
    s = scrape(registry)
    assert value(s, "tapupr_stream_flow_control_blocked_seconds_total", **UPR) == 2.0
    assert value(s, "tapupr_stream_flow_control_unacked_bytes", **UPR) == 0


def test_tap_acks_nacks_retransmits(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock)
    stream = open_stream(TAP_FRONT, "replica-1")
    stream.ack_window, stream.acks_pending = 10, 4
    stream.nacks_total += 2
    stream.retransmits_total += 3
    s = scrape(registry)
    assert value(s, "tapupr_stream_tap_acks_pending", **TAP) == 4
    assert value(s, "tapupr_stream_tap_ack_window", **TAP) == 10
    assert value(s, "tapupr_stream_tap_nacks_total", **TAP) == 2
    assert value(s, "tapupr_stream_tap_retransmits_total", **TAP) == 3


def test_process_counters(stats, registry, clock) -> None:
    setup(stats, registry, clock)
    stats.rollbacks_total[UPR_FRONT] += 1
    stats.last_rollback_seqno[UPR_FRONT] = 4242
    stats.upstream_reconnects_total["old-node:11210"] += 3
    stats.stream_ends_total[UPR_FRONT, "closed"] += 2
    stats.stream_ends_total[TAP_FRONT, "state_changed"] += 1
    stats.protocol_errors_total[TAP_FRONT, "malformed"] += 5
    stats.takeovers_started_total[TAP_FRONT] += 2
    stats.takeovers_completed_total[TAP_FRONT] += 1
    s = scrape(registry)
    assert value(s, "tapupr_rollbacks_total", direction=UPR_FRONT) == 1
    assert value(s, "tapupr_rollbacks_total", direction=TAP_FRONT) == 0
    assert value(s, "tapupr_last_rollback_seqno", direction=UPR_FRONT) == 4242
    assert value(s, "tapupr_upstream_reconnects_total", upstream="old-node:11210") == 3
    assert value(s, "tapupr_stream_ends_total", direction=UPR_FRONT, reason="closed") == 2
    assert value(s, "tapupr_stream_ends_total", direction=TAP_FRONT, reason="state_changed") == 1
    assert value(s, "tapupr_protocol_errors_total", direction=TAP_FRONT, kind="malformed") == 5
    assert value(s, "tapupr_takeovers_started_total", direction=TAP_FRONT) == 2
    assert value(s, "tapupr_takeovers_completed_total", direction=TAP_FRONT) == 1


def test_upr_front_log(stats, registry, clock) -> None:
    setup(stats, registry, clock, per_vbucket=True)
    stats.upr_log.bytes_on_disk = 1 << 30
    stats.upr_log.compactions_total += 3
    stats.upr_log.failover_log_lengths.update({0: 1, 5: 4, 9: 2})
    s = scrape(registry)
    assert value(s, "tapupr_upr_front_log_bytes") == 1 << 30
    assert value(s, "tapupr_upr_front_log_compactions_total") == 3
    assert value(s, "tapupr_upr_front_failover_log_longest_entries") == 4
    assert value(s, "tapupr_upr_front_failover_log_entries", vbucket="5") == 4
    assert value(s, "tapupr_upr_front_failover_log_entries", vbucket="9") == 2


def test_upr_front_logs_set_aside_by_reason(stats, registry, clock) -> None:
    setup(stats, registry, clock)
    s = scrape(registry)
    assert value(s, "tapupr_upr_front_logs_set_aside_total", reason="segment_missing") == 0
    stats.upr_log.logs_set_aside_total["segment_missing"] += 2
    stats.upr_log.logs_set_aside_total["meta_damaged"] += 1
    s = scrape(registry)
    assert value(s, "tapupr_upr_front_logs_set_aside_total", reason="segment_missing") == 2
    assert value(s, "tapupr_upr_front_logs_set_aside_total", reason="meta_damaged") == 1
    assert value(s, "tapupr_upr_front_logs_set_aside_total", reason="directory_missing") == 0


def test_last_item_timestamp_appears_with_the_first_item(
    stats, registry, clock, open_stream
) -> None:
    setup(stats, registry, clock)
    stream = open_stream(TAP_FRONT, "replica-1")
    s = scrape(registry)
    assert ("tapupr_stream_last_item_timestamp_seconds", frozenset(TAP.items())) not in s
    assert value(s, "tapupr_stream_start_timestamp_seconds", **TAP) == NOW - 60
    stream.last_item_time = NOW - 1
    assert value(scrape(registry), "tapupr_stream_last_item_timestamp_seconds", **TAP) == NOW - 1


def test_per_vbucket_series_only_when_asked(stats, clock, open_stream) -> None:
    stream = open_stream(TAP_FRONT, "replica-1")
    p = stream.vbucket(12)
    p.upstream_high_seqno, p.sent_seqno, p.acked_seqno = 30, 20, 10
    p.backfilling, p.backfill_end_seqno = True, 25
    plain = CollectorRegistry()
    register_gateway_metrics(plain, stats, clock=clock)
    assert not [k for k in scrape(plain) if k[0].startswith("tapupr_vbucket_")]
    detailed = CollectorRegistry()
    register_gateway_metrics(detailed, stats, clock=clock, per_vbucket=True)
    s = scrape(detailed)
    labels = {**TAP, "vbucket": "12"}
    assert value(s, "tapupr_vbucket_upstream_high_seqno", **labels) == 30
    assert value(s, "tapupr_vbucket_sent_seqno", **labels) == 20
    assert value(s, "tapupr_vbucket_acked_seqno", **labels) == 10
    assert value(s, "tapupr_vbucket_send_lag_seqnos", **labels) == 10
    assert value(s, "tapupr_vbucket_ack_lag_seqnos", **labels) == 20
    assert value(s, "tapupr_vbucket_backfill_remaining_items", **labels) == 5
    assert value(s, "tapupr_vbucket_backfilling", **labels) == 1


def test_connections_sharing_labels_are_one_series(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock, per_vbucket=True)
    old, new = open_stream(TAP_FRONT, "replica-1"), open_stream(TAP_FRONT, "replica-1")
    old.items_sent["mutation"] += 3
    new.items_sent["mutation"] += 4
    old.oldest_unacked_time, new.oldest_unacked_time = NOW - 9, NOW - 1
    old.vbucket(0).upstream_high_seqno = new.vbucket(0).upstream_high_seqno = 50
    old.vbucket(0).sent_seqno, new.vbucket(0).sent_seqno = 10, 40
    old.latency.observe(0.01)
    new.latency.observe(0.02)
    s = scrape(registry)  # parse() asserts no duplicate series
    assert value(s, "tapupr_stream_items_sent_total", **TAP, kind="mutation") == 7
    assert value(s, "tapupr_stream_ack_lag_seconds", **TAP) == 9
    assert value(s, "tapupr_stream_ack_latency_seconds_count", **TAP) == 2
    assert value(s, "tapupr_vbucket_send_lag_seqnos", **TAP, vbucket="0") == 40  # the one behind
    assert value(s, "tapupr_active_connections", direction=TAP_FRONT) == 2


def test_openmetrics_rendering(stats, registry, clock, open_stream) -> None:
    setup(stats, registry, clock)
    stream = open_stream(TAP_FRONT, "replica-1")
    stream.items_sent["mutation"] += 1
    stream.latency.observe(0.1)
    text = openmetrics_latest(registry).decode()
    assert text.endswith("# EOF\n")
    assert "# UNIT tapupr_stream_ack_lag_seconds seconds" in text
    names = {f.name: f for f in parse_openmetrics(text)}
    assert names["tapupr_stream_items_sent"].type == "counter"
    assert names["tapupr_stream_ack_latency_seconds"].type == "histogram"


def test_injected_registry_only(stats, registry, clock) -> None:
    before = set(REGISTRY._names_to_collectors)
    setup(stats, registry, clock)
    assert set(REGISTRY._names_to_collectors) == before
    assert "tapupr_stream_ack_lag_seconds" in registry._names_to_collectors
    with pytest.raises(ValueError, match="Duplicated"):
        register_gateway_metrics(registry, stats)


def test_collect_survives_mutation_from_another_thread(stats, open_stream) -> None:
    """The fronts mutate on their thread while a scrape may run in another."""
    from gateway.metrics.figures import StreamStats

    collector: Collector = GatewayCollector(stats, per_vbucket=True)
    stream = open_stream(UPR_FRONT, "xdcr")
    stop = threading.Event()
    failures: list[BaseException] = []

    def scrape_loop() -> None:
        try:
            while not stop.is_set():
                list(collector.collect())
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    thread = threading.Thread(target=scrape_loop)
    thread.start()
    try:
        for round_ in range(3000):
            vb = round_ % 97
            stream.vbucket(vb).upstream_high_seqno += 1
            stream.items_sent[ITEM_KINDS[round_ % len(ITEM_KINDS)]] += 1
            if round_ % 7 == 0:
                stream.vbuckets.pop((vb + 13) % 97, None)
            if round_ % 50 == 0:
                with stats.stream(StreamStats(TAP_FRONT, f"c{round_}", "n")):
                    stats.stream_ends_total[TAP_FRONT, f"r{round_ % 5}"] += 1
    finally:
        stop.set()
        thread.join()
    assert failures == []


vb_progress = st.tuples(
    st.integers(0, 10_000), st.integers(0, 10_000), st.integers(0, 10_000), st.booleans(),
    st.integers(0, 10_000),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    vbuckets=st.dictionaries(st.integers(0, 1023), vb_progress, max_size=20),
    latencies=st.lists(st.floats(0, 120, allow_nan=False), max_size=30),
)
def test_stream_figures_agree_with_per_vbucket_series(
    vbuckets: dict[int, tuple[int, int, int, bool, int]], latencies: list[float]
) -> None:
    from gateway.metrics.figures import StreamStats

    stats = GatewayStats()
    registry = CollectorRegistry()
    register_gateway_metrics(registry, stats, per_vbucket=True, clock=Clock())
    with stats.stream(StreamStats(TAP_FRONT, "replica-1", "node:11210")) as stream:
        for vb, (high, sent, acked, backfilling, end) in vbuckets.items():
            p = stream.vbucket(vb)
            p.upstream_high_seqno, p.sent_seqno, p.acked_seqno = high, sent, acked
            p.backfilling, p.backfill_end_seqno = backfilling, end
        for seconds in latencies:
            stream.latency.observe(seconds)
        s = scrape(registry)
    for stream_name, vb_name in (
        ("tapupr_stream_send_lag_seqnos", "tapupr_vbucket_send_lag_seqnos"),
        ("tapupr_stream_ack_lag_seqnos", "tapupr_vbucket_ack_lag_seqnos"),
        ("tapupr_stream_backfill_remaining_items", "tapupr_vbucket_backfill_remaining_items"),
    ):
        per_vb = [v for (name, _), v in s.items() if name == vb_name]
        assert len(per_vb) == len(vbuckets)
        assert min(per_vb, default=0) >= 0
        assert value(s, stream_name, **TAP) == sum(per_vb)
    buckets = [
        v for (name, labels), v in s.items() if name == "tapupr_stream_ack_latency_seconds_bucket"
    ]
    assert buckets == sorted(buckets)  # cumulative
    assert buckets[-1] == value(s, "tapupr_stream_ack_latency_seconds_count", **TAP)
    assert buckets[-1] == len(latencies)


def test_upr_front_log_damage_by_vbucket(stats, registry, clock) -> None:
    setup(stats, registry, clock)
    stats.upr_log.log_damage_total[3] += 1
    s = scrape(registry)
    assert value(s, "tapupr_upr_front_log_damage_total", vbucket="3") == 1
