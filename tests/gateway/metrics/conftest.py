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

from gateway.stats import GatewayStats, StreamStats
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
