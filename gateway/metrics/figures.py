"""Live figures of the gateway's streams, kept as plain counters on the hot path.

Both fronts update these objects as they stream (attribute increments, no
locks, no label lookups); the Prometheus collector and the memcached
``STAT tap`` / ``STAT upr`` groups read them when asked. So a scrape costs
the streams nothing, and both views always agree.

- ``GatewayStats``: one per gateway process; holds the live streams and the
  counters that outlive a connection (reconnects, rollbacks, stream ends by
  reason, protocol errors by kind, takeovers, UPR-front log figures).
- ``StreamStats``: one per downstream connection (a TAP client or a UPR
  consumer connection), with per-vbucket progress in ``VbProgress``.
- ``LatencyHistogram``: fixed buckets, observed per acknowledged item.

Wall-clock times (``time.time()``) are used where a figure is exported as a
timestamp; durations come from the caller's monotonic clock.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gateway.io.limits import ListenerCounters

TAP_FRONT = "tap_front"
UPR_FRONT = "upr_front"
DIRECTIONS = (TAP_FRONT, UPR_FRONT)

ITEM_KINDS = ("mutation", "deletion", "expiration", "marker", "state")
"""What ``StreamStats.items_sent`` counts: markers are snapshot markers (UPR)
or checkpoint start/end (TAP); states are vbucket state changes."""

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)  # fmt: skip


class LatencyHistogram:
    """Counts per upper bound (seconds); the last slot is +Inf."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, cumulative count) pairs as Prometheus expects, +Inf last."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass(slots=True)
class VbProgress:
    """One vbucket of one stream, in seqnos of the UPR side of the translation."""

    upstream_high_seqno: int = 0
    """Newest seqno known upstream (UPR node's high seqno, or the gateway log's)."""
    sent_seqno: int = 0
    acked_seqno: int = 0
    """Last seqno the downstream confirmed (TAP ack, or UPR buffer ack)."""
    backfilling: bool = False
    backfill_end_seqno: int = 0

    @property
    def lag_sent(self) -> int:
        return max(0, self.upstream_high_seqno - self.sent_seqno)

    @property
    def lag_acked(self) -> int:
        return max(0, self.upstream_high_seqno - self.acked_seqno)

    @property
    def backfill_remaining(self) -> int:
        return max(0, self.backfill_end_seqno - self.sent_seqno) if self.backfilling else 0


@dataclass(slots=True)
class StreamStats:
    """One downstream connection of a front (see the module docstring)."""

    direction: str
    connection: str
    upstream: str
    created: float = 0.0
    """Wall-clock time the connection was accepted."""
    items_sent: Counter[str] = field(default_factory=Counter)
    bytes_sent: int = 0
    vbuckets: dict[int, VbProgress] = field(default_factory=dict)
    # Flow control (UPR consumers' window, or the TAP front's upstream window).
    buffer_size: int = 0
    unacked_bytes: int = 0
    blocked_seconds: float = 0.0
    """Total time spent with a full window, up to ``blocked_since`` (seconds)."""
    blocked_since: float | None = None
    """``time.monotonic()`` when the current full-window stall began (None: not blocked)."""
    # TAP acks.
    acks_pending: int = 0
    ack_window: int = 0
    """Most unacknowledged TAP messages allowed before the front waits (0: acks off)."""
    nacks_total: int = 0
    retransmits_total: int = 0
    oldest_unacked_time: float | None = None
    """Wall-clock arrival time of the oldest item sent but not yet acknowledged."""
    last_item_time: float = 0.0
    """Wall-clock time the last item was sent downstream (0: none yet)."""
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    """Upstream arrival to downstream acknowledgement, per item."""

    def vbucket(self, vb: int) -> VbProgress:
        progress = self.vbuckets.get(vb)
        if progress is None:
            progress = self.vbuckets[vb] = VbProgress()
        return progress

    @property
    def lag_sent(self) -> int:
        return sum(p.lag_sent for p in self.vbuckets.values())

    @property
    def lag_acked(self) -> int:
        return sum(p.lag_acked for p in self.vbuckets.values())

    @property
    def backfill_remaining(self) -> int:
        return sum(p.backfill_remaining for p in self.vbuckets.values())

    @property
    def backfilling(self) -> bool:
        return any(p.backfilling for p in self.vbuckets.values())

    def blocked_total(self) -> float:
        """Time spent blocked, the stall under way included."""
        since = self.blocked_since
        ongoing = 0.0 if since is None else max(0.0, time.monotonic() - since)
        return self.blocked_seconds + ongoing

    def oldest_unacked_age(self, now: float) -> float:
        return 0.0 if self.oldest_unacked_time is None else max(0.0, now - self.oldest_unacked_time)


@dataclass(slots=True)
class UprLogStats:
    """The UPR front's durable log, as a whole."""

    bytes_on_disk: int = 0
    compactions_total: int = 0
    failover_log_lengths: dict[int, int] = field(default_factory=dict)
    logs_set_aside_total: Counter[str] = field(default_factory=Counter)
    """Vbucket logs start-up could not prove and set aside, by reason (``proof.KINDS``)."""
    log_damage_total: Counter[int] = field(default_factory=Counter)
    """Damage found while serving a vbucket's log (then set aside and re-fetched), by vbucket."""
    write_failures_total: Counter[str] = field(default_factory=Counter)
    """Log writes the file system refused (nothing of them acked, retried), by errno name."""
    last_write_failure: str | None = None
    bytes_at_write_failure: int = 0

    def note_write_failure(self, errno_name: str, message: str) -> None:
        self.write_failures_total[errno_name] += 1
        self.last_write_failure = message
        self.bytes_at_write_failure = self.bytes_on_disk

    def write_failing(self) -> str | None:
        """The last failed write while the log has not grown since (no write went
        through); a compaction in between keeps it said a little longer."""
        if self.last_write_failure is None or self.bytes_on_disk > self.bytes_at_write_failure:
            return None
        return self.last_write_failure


@dataclass
class GatewayStats:
    """Everything one gateway process reports (see the module docstring)."""

    streams: dict[int, StreamStats] = field(default_factory=dict)
    connections_total: Counter[str] = field(default_factory=Counter)
    """Downstream connections accepted, by direction."""
    upstream_reconnects_total: Counter[str] = field(default_factory=Counter)
    """By upstream address."""
    rollbacks_total: Counter[str] = field(default_factory=Counter)
    """By direction."""
    last_rollback_seqno: dict[str, int] = field(default_factory=dict)
    stream_ends_total: Counter[tuple[str, str]] = field(default_factory=Counter)
    """By (direction, reason)."""
    protocol_errors_total: Counter[tuple[str, str]] = field(default_factory=Counter)
    """By (direction, kind): kind is a short word such as ``malformed`` or ``unknown_opcode``."""
    takeovers_started_total: Counter[str] = field(default_factory=Counter)
    takeovers_completed_total: Counter[str] = field(default_factory=Counter)
    upr_log: UprLogStats = field(default_factory=UprLogStats)
    tap_front_state_set_aside_total: int = 0
    """TAP front state files start-up could not read: set aside, clients backfill."""
    closed_items_sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Items sent by connections since closed, by (direction, kind), so totals never fall."""
    closed_bytes_sent: Counter[str] = field(default_factory=Counter)
    """Bytes sent by connections since closed, by direction."""
    listeners: ListenerCounters = field(default_factory=ListenerCounters)
    """Connections and attempts the listeners refused or cut off (``gateway.io.limits``)."""

    @contextmanager
    def stream(self, stats: StreamStats) -> Iterator[StreamStats]:
        """Register ``stats`` for as long as its connection lives."""
        key = id(stats)
        self.streams[key] = stats
        self.connections_total[stats.direction] += 1
        try:
            yield stats
        finally:
            if self.streams.pop(key, None) is not None:
                for kind, count in stats.items_sent.items():
                    self.closed_items_sent[stats.direction, kind] += count
                self.closed_bytes_sent[stats.direction] += stats.bytes_sent

    def active(self, direction: str) -> list[StreamStats]:
        return [s for s in self.streams.values() if s.direction == direction]
