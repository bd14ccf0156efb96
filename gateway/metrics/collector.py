"""The Prometheus collector: ``GatewayStats`` turned into metric families at scrape time.

Nothing is registered or updated on the hot path: the fronts bump plain
counters in ``gateway.metrics.figures`` and this collector reads them when a scrape
asks. It is registered on an injected ``CollectorRegistry`` (never the
global one) with ``register_gateway_metrics``. The families themselves (names,
labels, help) are defined in ``gateway.metrics.families``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

from gateway.metrics.families import gateway_families
from gateway.metrics.figures import GatewayStats
from gateway.metrics.render import to_metrics
from gateway.metrics.view import StatsView, capture, capture_anywhere

Clock = Callable[[], float]


def families(view: StatsView, *, per_vbucket: bool = False) -> list[Metric]:
    """Every metric family of one scrape of ``view``, as ``prometheus_client`` objects."""
    return to_metrics(gateway_families(view, per_vbucket=per_vbucket))


class GatewayCollector:
    """Collects a ``GatewayStats`` on demand.

    ``collect`` captures the stats itself, safely from any thread. A caller on
    the trio thread can instead capture there and render elsewhere:
    ``with collector.pinned(collector.capture()): generate_latest(registry)``;
    ``pinned(view, skip=True)`` makes ``collect`` yield nothing, for a caller
    that writes the gateway's families itself (``serve_metrics`` does, faster).
    """

    def __init__(
        self, stats: GatewayStats, *, per_vbucket: bool = False, clock: Clock = time.time
    ) -> None:
        self.stats = stats
        self.per_vbucket = per_vbucket
        self.clock = clock
        self._local = threading.local()

    def capture(self) -> StatsView:
        """A view for ``pinned``; call on the thread that mutates the stats."""
        return capture(self.stats, self.clock())

    @contextmanager
    def pinned(self, view: StatsView, *, skip: bool = False) -> Iterator[None]:
        """Make ``collect`` on this thread use ``view`` (or nothing) instead of capturing."""
        self._local.view, self._local.skip = view, skip
        try:
            yield
        finally:
            self._local.view, self._local.skip = None, False

    def describe(self) -> list[Metric]:
        """Every family name (empty), so the registry can refuse clashes."""
        empty = capture(GatewayStats(), 0.0)
        return families(empty, per_vbucket=self.per_vbucket)

    def collect(self) -> list[Metric]:
        if getattr(self._local, "skip", False):
            return []
        view: StatsView | None = getattr(self._local, "view", None)
        if view is None:
            view = capture_anywhere(self.stats, self.clock())
        return families(view, per_vbucket=self.per_vbucket)


def register_gateway_metrics(
    registry: CollectorRegistry,
    stats: GatewayStats,
    *,
    per_vbucket: bool = False,
    clock: Clock = time.time,
) -> GatewayCollector:
    """Create a collector over ``stats`` and register it on ``registry``."""
    collector = GatewayCollector(stats, per_vbucket=per_vbucket, clock=clock)
    registry.register(collector)
    return collector
