"""A scrape's view of ``GatewayStats``: copies of what changes shape, taken at once.

The fronts mutate the stats on the trio thread while a scrape renders in a
worker thread. ``capture`` copies, in one go, every container whose size can
change (the set of live streams, the process-wide counters); each copy is a
single C-level ``dict()``/``tuple()`` call, so under the GIL it cannot observe
a half-done insertion. Counters of closed connections and the list of live
streams are therefore consistent with each other, and process totals never
dip while a connection closes.

Per-stream figures are read later, from the worker thread, by
``stream_figures``: it copies each stream's dicts the same way and reads each
field once, so a concurrent update yields a value from just before or just
after it, never an exception. Call ``capture`` on the trio thread when one is
at hand (``serve_metrics`` does); ``capture_anywhere`` retries if a copy ever
races a resize in another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from gateway.io.limits import ListenerCounters
from gateway.metrics.figures import GatewayStats, StreamStats

StreamKey = tuple[str, str, str]
"""(direction, connection, upstream): the labels of one stream's series."""

CAPTURE_ATTEMPTS = 5

K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class StatsView:
    now: float
    """Wall-clock time of the capture: ages are measured against it."""
    streams: tuple[StreamStats, ...]
    connections_total: dict[str, int]
    closed_items_sent: dict[tuple[str, str], int]
    closed_bytes_sent: dict[str, int]
    upstream_reconnects_total: dict[str, int]
    rollbacks_total: dict[str, int]
    last_rollback_seqno: dict[str, int]
    stream_ends_total: dict[tuple[str, str], int]
    protocol_errors_total: dict[tuple[str, str], int]
    takeovers_started_total: dict[str, int]
    takeovers_completed_total: dict[str, int]
    upr_log_bytes: int
    upr_log_compactions_total: int
    failover_log_lengths: dict[int, int]
    upr_logs_set_aside_total: dict[str, int]
    upr_log_damage_total: dict[int, int]
    upr_log_write_failures_total: dict[str, int]
    tap_front_state_set_aside_total: int
    listeners: ListenerCounters = field(default_factory=ListenerCounters)


def capture(stats: GatewayStats, now: float) -> StatsView:
    log = stats.upr_log
    return StatsView(
        now=now,
        streams=tuple(stats.streams.values()),
        connections_total=dict(stats.connections_total),
        closed_items_sent=dict(stats.closed_items_sent),
        closed_bytes_sent=dict(stats.closed_bytes_sent),
        upstream_reconnects_total=dict(stats.upstream_reconnects_total),
        rollbacks_total=dict(stats.rollbacks_total),
        last_rollback_seqno=dict(stats.last_rollback_seqno),
        stream_ends_total=dict(stats.stream_ends_total),
        protocol_errors_total=dict(stats.protocol_errors_total),
        takeovers_started_total=dict(stats.takeovers_started_total),
        takeovers_completed_total=dict(stats.takeovers_completed_total),
        upr_log_bytes=log.bytes_on_disk,
        upr_log_compactions_total=log.compactions_total,
        failover_log_lengths=dict(log.failover_log_lengths),
        upr_logs_set_aside_total=dict(log.logs_set_aside_total),
        upr_log_damage_total=dict(log.log_damage_total),
        upr_log_write_failures_total=dict(log.write_failures_total),
        tap_front_state_set_aside_total=stats.tap_front_state_set_aside_total,
        listeners=stats.listeners.copy(),
    )


def capture_anywhere(stats: GatewayStats, now: float) -> StatsView:
    """``capture`` from any thread: retries a copy that raced a resize."""
    for _ in range(CAPTURE_ATTEMPTS - 1):
        try:
            return capture(stats, now)
        except RuntimeError:
            continue
    return capture(stats, now)


@dataclass(slots=True)
class VbRow:
    high_seqno: int
    sent_seqno: int
    acked_seqno: int
    backfill_remaining: int
    backfilling: bool

    @property
    def send_lag(self) -> int:
        return max(0, self.high_seqno - self.sent_seqno)

    @property
    def ack_lag(self) -> int:
        return max(0, self.high_seqno - self.acked_seqno)

    def merge(self, other: VbRow) -> None:
        """Two connections under one name on one vbucket: report the one behind."""
        self.high_seqno = max(self.high_seqno, other.high_seqno)
        self.sent_seqno = min(self.sent_seqno, other.sent_seqno)
        self.acked_seqno = min(self.acked_seqno, other.acked_seqno)
        self.backfill_remaining = max(self.backfill_remaining, other.backfill_remaining)
        self.backfilling = self.backfilling or other.backfilling


@dataclass(slots=True)
class StreamFigures:
    """One stream's figures, read once; streams sharing labels are merged."""

    items_sent: dict[str, int]
    bytes_sent: int
    vbuckets: int
    send_lag: int
    ack_lag: int
    backfill_remaining: int
    backfilling_vbuckets: int
    buffer_size: int
    unacked_bytes: int
    blocked_seconds: float
    acks_pending: int
    ack_window: int
    nacks_total: int
    retransmits_total: int
    oldest_unacked_age: float
    last_item_time: float
    created: float
    latency_counts: list[int]
    latency_sum: float
    rows: dict[int, VbRow] = field(default_factory=dict)
    """Per vbucket, only when asked for."""

    def merge(self, other: StreamFigures) -> None:
        for kind, count in other.items_sent.items():
            self.items_sent[kind] = self.items_sent.get(kind, 0) + count
        for name in (
            "bytes_sent", "vbuckets", "send_lag", "ack_lag", "backfill_remaining",
            "backfilling_vbuckets", "buffer_size", "unacked_bytes", "blocked_seconds",
            "acks_pending", "ack_window", "nacks_total", "retransmits_total", "latency_sum",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.oldest_unacked_age = max(self.oldest_unacked_age, other.oldest_unacked_age)
        self.last_item_time = max(self.last_item_time, other.last_item_time)
        self.created = min(self.created, other.created) if self.created else other.created
        counts = zip(self.latency_counts, other.latency_counts, strict=True)
        self.latency_counts = [a + b for a, b in counts]
        for vb, row in other.rows.items():
            mine = self.rows.get(vb)
            if mine is None:
                self.rows[vb] = row
            else:
                mine.merge(row)


def _copy_dict(d: dict[K, V]) -> dict[K, V]:
    for _ in range(CAPTURE_ATTEMPTS - 1):
        try:
            return dict(d)
        except RuntimeError:
            continue
    return dict(d)


def stream_figures(stream: StreamStats, now: float, *, per_vbucket: bool) -> StreamFigures:
    send_lag = ack_lag = backfill = backfilling = 0
    rows: dict[int, VbRow] = {}
    vbuckets = _copy_dict(stream.vbuckets)
    for vb, p in vbuckets.items():
        high, sent, acked = p.upstream_high_seqno, p.sent_seqno, p.acked_seqno
        in_backfill = p.backfilling
        remaining = max(0, p.backfill_end_seqno - sent) if in_backfill else 0
        send_lag += max(0, high - sent)
        ack_lag += max(0, high - acked)
        backfill += remaining
        backfilling += in_backfill
        if per_vbucket:
            rows[vb] = VbRow(high, sent, acked, remaining, in_backfill)
    oldest = stream.oldest_unacked_time
    latency = stream.latency
    counts = list(latency.counts)
    return StreamFigures(
        items_sent=_copy_dict(stream.items_sent),
        bytes_sent=stream.bytes_sent,
        vbuckets=len(vbuckets),
        send_lag=send_lag,
        ack_lag=ack_lag,
        backfill_remaining=backfill,
        backfilling_vbuckets=backfilling,
        buffer_size=stream.buffer_size,
        unacked_bytes=stream.unacked_bytes,
        blocked_seconds=stream.blocked_total(),
        acks_pending=stream.acks_pending,
        ack_window=stream.ack_window,
        nacks_total=stream.nacks_total,
        retransmits_total=stream.retransmits_total,
        oldest_unacked_age=0.0 if oldest is None else max(0.0, now - oldest),
        last_item_time=stream.last_item_time,
        created=stream.created,
        latency_counts=counts,
        latency_sum=latency.sum,
        rows=rows,
    )


def figures_by_stream(view: StatsView, *, per_vbucket: bool) -> dict[StreamKey, StreamFigures]:
    """Figures of every live stream, keyed (and merged) by their labels, sorted."""
    out: dict[StreamKey, StreamFigures] = {}
    for stream in view.streams:
        key = (stream.direction, stream.connection, stream.upstream)
        figures = stream_figures(stream, view.now, per_vbucket=per_vbucket)
        mine = out.get(key)
        if mine is None:
            out[key] = figures
        else:
            mine.merge(figures)
    return dict(sorted(out.items()))
