"""The Prometheus collector: ``GatewayStats`` turned into metric families at scrape time.

Nothing is registered or updated on the hot path: the fronts bump plain
counters in ``gateway.stats`` and this collector reads them when a scrape
asks. It is registered on an injected ``CollectorRegistry`` (never the
global one) with ``register_gateway_metrics``.

Names follow the Prometheus conventions: prefix ``tapupr_``, base units in
the name (``_seconds``, ``_bytes``), ``_total`` on counters. Labels stay
small: ``direction``, ``connection`` and ``upstream`` per stream; the
per-vbucket families (an extra ``vbucket`` label, 1024 vbuckets times every
stream) exist only with ``per_vbucket=True``.

Streams that share all three labels (a client reconnecting under the same
name before its old connection is gone) are reported as one series: sums,
or the worst of the two for ages and lags per vbucket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from gateway.metrics.view import (
    StatsView,
    StreamFigures,
    StreamKey,
    capture,
    capture_anywhere,
    figures_by_stream,
)
from gateway.stats import DIRECTIONS, ITEM_KINDS, LATENCY_BUCKETS, GatewayStats

PREFIX = "tapupr_"
STREAM_LABELS = ("direction", "connection", "upstream")
VBUCKET_LABELS = (*STREAM_LABELS, "vbucket")
BUCKET_BOUNDS = (*map(str, LATENCY_BUCKETS), "+Inf")

Clock = Callable[[], float]


def _gauge(name: str, doc: str, labels: tuple[str, ...] = (), unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels), unit=unit)


def _counter(
    name: str, doc: str, labels: tuple[str, ...] = (), unit: str = ""
) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=list(labels), unit=unit)


# Per-stream gauges and counters that are one attribute of StreamFigures each:
# (kind, name without prefix, attribute, unit, help).
_STREAM_SCALARS: tuple[tuple[str, str, str, str, str], ...] = (
    ("counter", "stream_sent_bytes_total", "bytes_sent", "bytes",
     "Bytes sent downstream on this connection."),
    ("gauge", "stream_vbuckets", "vbuckets", "",
     "Vbuckets this connection streams."),
    ("gauge", "stream_send_lag_seqnos", "send_lag", "",
     "Upstream high seqno minus the last seqno sent, summed over the stream's vbuckets."),
    ("gauge", "stream_ack_lag_seqnos", "ack_lag", "",
     "Upstream high seqno minus the last seqno acknowledged downstream, summed over vbuckets."),
    ("gauge", "stream_ack_lag_seconds", "oldest_unacked_age", "seconds",
     "Age of the oldest item sent downstream and not yet acknowledged (0: none pending)."),
    ("gauge", "stream_backfill_remaining_items", "backfill_remaining", "",
     "Items still to send from backfills in progress."),
    ("gauge", "stream_backfilling_vbuckets", "backfilling_vbuckets", "",
     "Vbuckets of this stream currently backfilling."),
    ("gauge", "stream_flow_control_buffer_bytes", "buffer_size", "bytes",
     "Flow-control window size (0: flow control off)."),
    ("gauge", "stream_flow_control_unacked_bytes", "unacked_bytes", "bytes",
     "Bytes sent and not yet acknowledged under flow control."),
    ("counter", "stream_flow_control_blocked_seconds_total", "blocked_seconds", "seconds",
     "Time spent waiting on a full flow-control window."),
    ("gauge", "stream_tap_acks_pending", "acks_pending", "",
     "TAP messages sent that ask for an ack and have none yet."),
    ("gauge", "stream_tap_ack_window", "ack_window", "",
     "Most unacknowledged TAP messages allowed before sending waits (0: acks off)."),
    ("counter", "stream_tap_nacks_total", "nacks_total", "",
     "Negative TAP acknowledgements received."),
    ("counter", "stream_tap_retransmits_total", "retransmits_total", "",
     "TAP messages sent again after a nack."),
)  # fmt: skip

_VBUCKET_SCALARS: tuple[tuple[str, str, str], ...] = (
    ("vbucket_upstream_high_seqno", "high_seqno", "Newest seqno known upstream."),
    ("vbucket_sent_seqno", "sent_seqno", "Last seqno sent downstream."),
    ("vbucket_acked_seqno", "acked_seqno", "Last seqno acknowledged downstream."),
    ("vbucket_send_lag_seqnos", "send_lag", "Upstream high seqno minus last seqno sent."),
    ("vbucket_ack_lag_seqnos", "ack_lag", "Upstream high seqno minus last seqno acknowledged."),
    ("vbucket_backfill_remaining_items", "backfill_remaining", "Items left in the backfill."),
    ("vbucket_backfilling", "backfilling", "1 while the vbucket is backfilling."),
)


def stream_families(streams: dict[StreamKey, StreamFigures], *, per_vbucket: bool) -> list[Metric]:
    items = _counter(
        "stream_items_sent_total",
        "Items sent downstream, by kind (marker: snapshot marker or checkpoint start/end; "
        "state: vbucket state change).",
        (*STREAM_LABELS, "kind"),
    )
    scalars: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [
        ((_counter if kind == "counter" else _gauge)(name, doc, STREAM_LABELS, unit), attr)
        for kind, name, attr, unit, doc in _STREAM_SCALARS
    ]
    backfill_on = _gauge("stream_backfill_in_progress", "1 while any vbucket of the stream "
                         "is backfilling.", STREAM_LABELS)  # fmt: skip
    latency = HistogramMetricFamily(
        PREFIX + "stream_ack_latency_seconds",
        "Time from an item's arrival from upstream to its acknowledgement downstream.",
        labels=list(STREAM_LABELS),
        unit="seconds",
    )
    last_item = _gauge(
        "stream_last_item_timestamp_seconds",
        "Wall-clock time the last item was sent downstream (absent before the first).",
        STREAM_LABELS,
        "seconds",
    )
    started = _gauge(
        "stream_start_timestamp_seconds",
        "Wall-clock time the downstream connection was accepted.",
        STREAM_LABELS,
        "seconds",
    )
    vb_families = [
        (_gauge(name, doc, VBUCKET_LABELS), attr) for name, attr, doc in _VBUCKET_SCALARS
    ]
    for key, fig in streams.items():
        labels = list(key)
        for kind in sorted({*ITEM_KINDS, *fig.items_sent}):
            items.add_metric([*labels, kind], fig.items_sent.get(kind, 0))
        for family, attr in scalars:
            family.add_metric(labels, getattr(fig, attr))
        backfill_on.add_metric(labels, 1 if fig.backfilling_vbuckets else 0)
        running = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip(BUCKET_BOUNDS, fig.latency_counts, strict=True):
            running += count
            buckets.append((bound, running))
        latency.add_metric(labels, buckets, fig.latency_sum)
        if fig.last_item_time > 0:
            last_item.add_metric(labels, fig.last_item_time)
        if fig.created > 0:
            started.add_metric(labels, fig.created)
        if per_vbucket:
            for vb in sorted(fig.rows):
                row = fig.rows[vb]
                vb_labels = [*labels, str(vb)]
                for family, attr in vb_families:
                    family.add_metric(vb_labels, float(getattr(row, attr)))
    out: list[Metric] = [items, *(f for f, _ in scalars), backfill_on, latency, last_item, started]
    if per_vbucket:
        out.extend(f for f, _ in vb_families)
    return out


def process_families(view: StatsView, *, per_vbucket: bool) -> list[Metric]:
    active = _gauge("active_connections", "Downstream connections open now.", ("direction",))
    accepted = _counter("connections_total", "Downstream connections accepted.", ("direction",))
    items = _counter(
        "items_sent_total",
        "Items sent downstream by all connections, open and closed, by kind.",
        ("direction", "kind"),
    )
    sent_bytes = _counter(
        "sent_bytes_total", "Bytes sent downstream by all connections.", ("direction",), "bytes"
    )
    live_items: dict[tuple[str, str], int] = dict(view.closed_items_sent)
    live_bytes: dict[str, int] = dict(view.closed_bytes_sent)
    open_count: dict[str, int] = {}
    for stream in view.streams:
        d = stream.direction
        open_count[d] = open_count.get(d, 0) + 1
        live_bytes[d] = live_bytes.get(d, 0) + stream.bytes_sent
        for kind, count in list(stream.items_sent.items()):
            live_items[d, kind] = live_items.get((d, kind), 0) + count
    directions = sorted({*DIRECTIONS, *open_count, *view.connections_total})
    for d in directions:
        active.add_metric([d], open_count.get(d, 0))
        accepted.add_metric([d], view.connections_total.get(d, 0))
        sent_bytes.add_metric([d], live_bytes.get(d, 0))
    for d, kind in sorted({*((d, k) for d in directions for k in ITEM_KINDS), *live_items}):
        items.add_metric([d, kind], live_items.get((d, kind), 0))

    reconnects = _counter(
        "upstream_reconnects_total", "Connections to an upstream node opened again.", ("upstream",)
    )
    for upstream, count in sorted(view.upstream_reconnects_total.items()):
        reconnects.add_metric([upstream], count)
    rollbacks = _counter("rollbacks_total", "Rollbacks answered or taken.", ("direction",))
    for d in sorted({*directions, *view.rollbacks_total}):
        rollbacks.add_metric([d], view.rollbacks_total.get(d, 0))
    last_rollback = _gauge(
        "last_rollback_seqno", "Seqno of the most recent rollback.", ("direction",)
    )
    for d, seqno in sorted(view.last_rollback_seqno.items()):
        last_rollback.add_metric([d], seqno)
    ends = _counter("stream_ends_total", "Streams ended, by reason.", ("direction", "reason"))
    for (d, reason), count in sorted(view.stream_ends_total.items()):
        ends.add_metric([d, reason], count)
    errors = _counter(
        "protocol_errors_total", "Bad input from a peer, by kind.", ("direction", "kind")
    )
    for (d, kind), count in sorted(view.protocol_errors_total.items()):
        errors.add_metric([d, kind], count)
    started = _counter("takeovers_started_total", "Vbucket takeovers begun.", ("direction",))
    done = _counter("takeovers_completed_total", "Vbucket takeovers completed.", ("direction",))
    for d in sorted({*directions, *view.takeovers_started_total, *view.takeovers_completed_total}):
        started.add_metric([d], view.takeovers_started_total.get(d, 0))
        done.add_metric([d], view.takeovers_completed_total.get(d, 0))

    log_bytes = _gauge(
        "upr_front_log_bytes", "Size on disk of the UPR front's durable log.", unit="bytes"
    )
    log_bytes.add_metric([], view.upr_log_bytes)
    compactions = _counter("upr_front_log_compactions_total", "Compactions of the UPR front's log.")
    compactions.add_metric([], view.upr_log_compactions_total)
    lengths = view.failover_log_lengths
    longest = _gauge(
        "upr_front_failover_log_longest_entries",
        "Entries in the longest failover log of the UPR front's vbuckets.",
    )
    longest.add_metric([], max(lengths.values(), default=0))
    out: list[Metric] = [
        active, accepted, items, sent_bytes, reconnects, rollbacks, last_rollback, ends, errors,
        started, done, log_bytes, compactions, longest,
    ]  # fmt: skip
    if per_vbucket:
        per_vb = _gauge(
            "upr_front_failover_log_entries",
            "Entries in the failover log of one vbucket of the UPR front.",
            ("vbucket",),
        )
        for vb, length in sorted(lengths.items()):
            per_vb.add_metric([str(vb)], length)
        out.append(per_vb)
    return out


def families(view: StatsView, *, per_vbucket: bool = False) -> list[Metric]:
    """Every metric family of one scrape of ``view``."""
    streams = figures_by_stream(view, per_vbucket=per_vbucket)
    return [
        *process_families(view, per_vbucket=per_vbucket),
        *stream_families(streams, per_vbucket=per_vbucket),
    ]


class GatewayCollector:
    """Collects a ``GatewayStats`` on demand (see the module docstring).

    ``collect`` captures the stats itself, safely from any thread. A caller on
    the trio thread can instead capture there and render elsewhere:
    ``with collector.pinned(collector.capture()): generate_latest(registry)``.
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
    def pinned(self, view: StatsView) -> Iterator[None]:
        """Make ``collect`` on this thread use ``view`` instead of capturing."""
        self._local.view = view
        try:
            yield
        finally:
            self._local.view = None

    def describe(self) -> list[Metric]:
        """Every family name (empty), so the registry can refuse clashes."""
        empty = capture(GatewayStats(), 0.0)
        return families(empty, per_vbucket=self.per_vbucket)

    def collect(self) -> list[Metric]:
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
