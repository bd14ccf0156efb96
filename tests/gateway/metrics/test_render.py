"""The direct renderer writes what prometheus_client's encoders write, parsed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.utils import floatToGoString

from gateway.metrics import register_gateway_metrics
from gateway.metrics.families import gateway_families
from gateway.metrics.figures import TAP_FRONT, GatewayStats, StreamStats
from gateway.metrics.render import _value, render
from gateway.metrics.view import capture
from tests.gateway.metrics.conftest import NOW, busy_stats


def summary(families: object) -> dict[str, tuple[str, str, str, set[tuple[object, ...]]]]:
    out = {}
    for f in families:  # type: ignore[attr-defined]
        samples = {(s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples}
        out[f.name] = (f.type, f.documentation, f.unit, samples)
    return out


def both(stats: GatewayStats, per_vbucket: bool) -> tuple[CollectorRegistry, str, str]:
    registry = CollectorRegistry()
    register_gateway_metrics(registry, stats, per_vbucket=per_vbucket, clock=lambda: NOW)
    ours = gateway_families(capture(stats, NOW), per_vbucket=per_vbucket)
    text = render(ours).decode()
    return registry, text, render(ours, openmetrics=True).decode() + "# EOF\n"


@pytest.mark.parametrize("per_vbucket", [False, True])
def test_same_as_prometheus_client(per_vbucket: bool) -> None:
    registry, text, om = both(busy_stats(), per_vbucket)
    reference_text = generate_latest(registry).decode()
    assert summary(parse_text(text)) == summary(parse_text(reference_text))
    assert len(text) == len(reference_text)  # same lines, labels in another order
    reference_om = openmetrics_latest(registry).decode()
    assert summary(parse_openmetrics(om)) == summary(parse_openmetrics(reference_om))


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(
        st.integers(-(10**12), 10**12),
        st.floats(allow_nan=False),
        st.sampled_from([float("inf"), float("-inf"), 0.0, -0.0, 1e6, 999_999, 1_000_000]),
    )
)
def test_numbers_as_go_writes_them(value: float) -> None:
    assert _value(value) == floatToGoString(value)


def test_nan() -> None:
    assert _value(float("nan")) == "NaN"


@settings(max_examples=60, deadline=None)
@given(name=st.text(min_size=1, max_size=30), upstream=st.text(max_size=20))
def test_any_connection_name_round_trips(name: str, upstream: str) -> None:
    stats = GatewayStats()
    stats.streams[0] = StreamStats(TAP_FRONT, name, upstream)
    _, text, om = both(stats, per_vbucket=False)
    for families in (parse_text(text), parse_openmetrics(om)):
        found = {
            (s.labels["connection"], s.labels["upstream"])
            for f in families
            for s in f.samples
            if "connection" in s.labels
        }
        assert found == {(name, upstream)}
