"""``promtool check metrics`` (Prometheus' own linter) on a rendered scrape."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from gateway.metrics import register_gateway_metrics
from tests.gateway.metrics.conftest import busy_stats
from tests.support.prometheus import MISSING, PROMTOOL


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
