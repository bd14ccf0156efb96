"""``promtool check metrics`` (Prometheus' own linter) on a rendered scrape."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from gateway.metrics import register_gateway_metrics
from gateway.stats import ITEM_KINDS, TAP_FRONT, UPR_FRONT, GatewayStats, StreamStats
from tests.support.prometheus import MISSING, PROMTOOL


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


@pytest.mark.parametrize("per_vbucket", [False, True])
def test_promtool_check_metrics(per_vbucket: bool) -> None:
    if PROMTOOL is None:
        pytest.skip(MISSING)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # as serve_metrics registers it
    register_gateway_metrics(registry, busy_stats(), per_vbucket=per_vbucket)
    text = generate_latest(registry)
    assert b"tapupr_stream_ack_latency_seconds_bucket" in text
    checked = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    problems = (checked.stdout + checked.stderr).decode()
    assert checked.returncode == 0, problems
    assert problems.strip() == ""
