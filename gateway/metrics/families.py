"""The gateway's metric families, built from a ``StatsView`` at scrape time.

Names follow the Prometheus conventions: prefix ``tapupr_``, base units in
the name (``_seconds``, ``_bytes``), ``_total`` on counters. Labels stay
small: ``direction``, ``connection`` and ``upstream`` per stream; the
per-vbucket families (an extra ``vbucket`` label, 1024 vbuckets times every
stream) exist only with ``per_vbucket=True``.

Families are plain data (``Family``) with label sets escaped once per
stream (``Labels``), so ``gateway.metrics.render`` can write the text
formats directly, several times faster than going through
``prometheus_client``'s generic objects; ``render.to_metrics`` converts to
those for registry users. Streams that share all three labels (a client
reconnecting under the same name before its old connection is gone) are
reported as one series: sums, or the worst of the two for ages and
per-vbucket lags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.fronts.upr.proof import KINDS as SET_ASIDE_REASONS
from gateway.metrics.figures import DIRECTIONS, ITEM_KINDS, LATENCY_BUCKETS
from gateway.metrics.view import StatsView, StreamFigures, StreamKey, figures_by_stream
from gateway.runtime.version import python_version, version

if TYPE_CHECKING:
    from gateway.metrics.health import Health

PREFIX = "tapupr_"
WRITE_FAILURE_ERRNOS = ("EDQUOT", "EFBIG", "EIO", "ENOSPC")
"""Shown at 0 from the start, so that an alert's ``increase()`` sees the first one."""
STREAM_LABELS = ("direction", "connection", "upstream")
BUCKET_BOUNDS = (*(repr(float(b)) for b in LATENCY_BUCKETS), "+Inf")


def escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@dataclass(frozen=True, slots=True)
class Labels:
    """A label set, with its exposition text (``a="x",b="y"``) made once."""

    names: tuple[str, ...]
    values: tuple[str, ...]
    text: str

    @classmethod
    def of(cls, **labels: str) -> Labels:
        return cls.make(tuple(labels), tuple(labels.values()))

    @classmethod
    def make(cls, names: tuple[str, ...], values: tuple[str, ...]) -> Labels:
        text = ",".join(f'{n}="{escape(v)}"' for n, v in zip(names, values, strict=True))
        return cls(names, values, text)


NO_LABELS = Labels((), (), "")

Sample = tuple[str, Labels, Labels | None, float]
"""(suffix after the family name, labels, more labels or None, value): the two label
sets are kept apart so a stream's escaped set is shared, not copied, per sample."""


@dataclass(slots=True)
class Family:
    name: str
    """Without ``_total`` for counters (the OpenMetrics family name)."""
    kind: str
    """``counter``, ``gauge`` or ``histogram``."""
    doc: str
    unit: str = ""
    samples: list[Sample] = field(default_factory=list)

    def add(
        self, labels: Labels, value: float, suffix: str = "", more: Labels | None = None
    ) -> None:
        self.samples.append((suffix, labels, more, value))


def gauge(name: str, doc: str, unit: str = "") -> Family:
    return Family(PREFIX + name, "gauge", doc, unit)


def counter(name: str, doc: str, unit: str = "") -> Family:
    return Family(PREFIX + name.removesuffix("_total"), "counter", doc, unit)


# Per-stream families that are one attribute of StreamFigures each:
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

_KIND_LABELS = {kind: Labels.of(kind=kind) for kind in ITEM_KINDS}
_BUCKET_LABELS = [Labels.of(le=bound) for bound in BUCKET_BOUNDS]
_VB_LABELS: dict[int, Labels] = {}
VB_LABEL_CACHE = 4096


def _vb_labels(vb: int) -> Labels:
    labels = _VB_LABELS.get(vb)
    if labels is None:
        labels = Labels.of(vbucket=str(vb))
        if vb < VB_LABEL_CACHE:
            _VB_LABELS[vb] = labels
    return labels


def stream_families(streams: dict[StreamKey, StreamFigures], *, per_vbucket: bool) -> list[Family]:
    items = counter(
        "stream_items_sent_total",
        "Items sent downstream, by kind (marker: snapshot marker or checkpoint start/end; "
        "state: vbucket state change).",
    )
    scalars = [
        ((counter if kind == "counter" else gauge)(name, doc, unit), attr)
        for kind, name, attr, unit, doc in _STREAM_SCALARS
    ]
    backfill_on = gauge(
        "stream_backfill_in_progress", "1 while any vbucket of the stream is backfilling."
    )
    latency = Family(
        PREFIX + "stream_ack_latency_seconds", "histogram",
        "Time from an item's arrival from upstream to its acknowledgement downstream.",
        "seconds",
    )  # fmt: skip
    last_item = gauge(
        "stream_last_item_timestamp_seconds",
        "Wall-clock time the last item was sent downstream (absent before the first).",
        "seconds",
    )
    started = gauge(
        "stream_start_timestamp_seconds",
        "Wall-clock time the downstream connection was accepted.",
        "seconds",
    )
    vb_families = [(gauge(name, doc), attr) for name, attr, doc in _VBUCKET_SCALARS]
    for key, fig in streams.items():
        labels = Labels.make(STREAM_LABELS, key)
        for kind in sorted({*ITEM_KINDS, *fig.items_sent}):
            kind_labels = _KIND_LABELS.get(kind) or Labels.of(kind=kind)
            items.add(labels, fig.items_sent.get(kind, 0), "_total", kind_labels)
        for family, attr in scalars:
            family.add(labels, getattr(fig, attr), "_total" if family.kind == "counter" else "")
        backfill_on.add(labels, 1 if fig.backfilling_vbuckets else 0)
        running = 0
        for bound_labels, count in zip(_BUCKET_LABELS, fig.latency_counts, strict=True):
            running += count
            latency.add(labels, running, "_bucket", bound_labels)
        latency.add(labels, running, "_count")
        latency.add(labels, fig.latency_sum, "_sum")
        if fig.last_item_time > 0:
            last_item.add(labels, fig.last_item_time)
        if fig.created > 0:
            started.add(labels, fig.created)
        if per_vbucket:
            for vb in sorted(fig.rows):
                row = fig.rows[vb]
                vb_labels = _vb_labels(vb)
                for family, attr in vb_families:
                    family.add(labels, getattr(row, attr), "", vb_labels)
    out = [items, *(f for f, _ in scalars), backfill_on, latency, last_item, started]
    if per_vbucket:
        out.extend(f for f, _ in vb_families)
    return out


def _by_direction(family: Family, values: dict[str, int] | dict[str, float], *keys: str) -> None:
    suffix = "_total" if family.kind == "counter" else ""
    for d in sorted({*keys, *values}):
        family.add(Labels.of(direction=d), values.get(d, 0), suffix)


def process_families(view: StatsView, *, per_vbucket: bool) -> list[Family]:
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

    active = gauge("active_connections", "Downstream connections open now.")
    _by_direction(active, open_count, *directions)
    accepted = counter("connections_total", "Downstream connections accepted.")
    _by_direction(accepted, view.connections_total, *directions)
    items = counter(
        "items_sent_total", "Items sent downstream by all connections, open and closed, by kind."
    )
    for d, kind in sorted({*((d, k) for d in directions for k in ITEM_KINDS), *live_items}):
        items.add(Labels.of(direction=d, kind=kind), live_items.get((d, kind), 0), "_total")
    sent_bytes = counter("sent_bytes_total", "Bytes sent downstream by all connections.", "bytes")
    _by_direction(sent_bytes, live_bytes, *directions)

    reconnects = counter(
        "upstream_reconnects_total", "Connections to an upstream node opened again."
    )
    for upstream, count in sorted(view.upstream_reconnects_total.items()):
        reconnects.add(Labels.of(upstream=upstream), count, "_total")
    rollbacks = counter("rollbacks_total", "Rollbacks answered or taken.")
    _by_direction(rollbacks, view.rollbacks_total, *directions)
    last_rollback = gauge("last_rollback_seqno", "Seqno of the most recent rollback.")
    _by_direction(last_rollback, view.last_rollback_seqno)
    ends = counter("stream_ends_total", "Streams ended, by reason.")
    for (d, reason), count in sorted(view.stream_ends_total.items()):
        ends.add(Labels.of(direction=d, reason=reason), count, "_total")
    errors = counter("protocol_errors_total", "Bad input from a peer, by kind.")
    for (d, kind), count in sorted(view.protocol_errors_total.items()):
        errors.add(Labels.of(direction=d, kind=kind), count, "_total")
    started = counter("takeovers_started_total", "Vbucket takeovers begun.")
    _by_direction(started, view.takeovers_started_total, *directions)
    done = counter("takeovers_completed_total", "Vbucket takeovers completed.")
    _by_direction(done, view.takeovers_completed_total, *directions)

    log_bytes = gauge(
        "upr_front_log_bytes", "Size on disk of the UPR front's durable log.", "bytes"
    )
    log_bytes.add(NO_LABELS, view.upr_log_bytes)
    compactions = counter("upr_front_log_compactions_total", "Compactions of the UPR front's log.")
    compactions.add(NO_LABELS, view.upr_log_compactions_total, "_total")
    lengths = view.failover_log_lengths
    longest = gauge(
        "upr_front_failover_log_longest_entries",
        "Entries in the longest failover log of the UPR front's vbuckets.",
    )
    longest.add(NO_LABELS, max(lengths.values(), default=0))
    set_aside = counter(
        "upr_front_logs_set_aside_total",
        "Vbucket logs the UPR front could not prove at start-up: set aside and re-fetched.",
    )
    aside = view.upr_logs_set_aside_total
    for reason in sorted({*SET_ASIDE_REASONS, *aside}):
        set_aside.add(Labels.of(reason=reason), aside.get(reason, 0), "_total")
    damage = counter(
        "upr_front_log_damage_total",
        "Damage found while serving a vbucket's log of the UPR front: set aside and re-fetched.",
    )
    for vb, count in sorted(view.upr_log_damage_total.items()):
        damage.add(_vb_labels(vb), count, "_total")
    write_failures = counter(
        "upr_front_log_write_failures_total",
        "Writes of the UPR front's log the file system refused (a full disk, a size limit), "
        "by errno: nothing of them acknowledged, written again once there is room.",
    )
    failed = view.upr_log_write_failures_total
    for name in sorted({*WRITE_FAILURE_ERRNOS, *failed}):
        write_failures.add(Labels.of(errno=name), failed.get(name, 0), "_total")
    tap_state = counter(
        "tap_front_state_set_aside_total",
        "TAP front state files that could not be read at start-up: set aside, clients backfill.",
    )
    tap_state.add(NO_LABELS, view.tap_front_state_set_aside_total, "_total")
    out = [
        active, accepted, items, sent_bytes, reconnects, rollbacks, last_rollback, ends, errors,
        started, done, log_bytes, compactions, longest, set_aside, damage, write_failures,
        tap_state,
    ]  # fmt: skip
    if per_vbucket:
        per_vb = gauge(
            "upr_front_failover_log_entries",
            "Entries in the failover log of one vbucket of the UPR front.",
        )
        for vb, length in sorted(lengths.items()):
            per_vb.add(_vb_labels(vb), length)
        out.append(per_vb)
    return out


def build_info() -> Family:
    info = gauge("build_info", "Always 1; the gateway's version and Python in its labels.")
    info.add(Labels.of(version=version(), python=python_version()), 1)
    return info


def health_families(health: Health) -> list[Family]:
    """Readiness and each upstream's last check, as ``/readyz`` says them, so an
    alert needs no HTTP probe beside the scrape. Call on the trio thread."""
    ready = gauge("ready", "1 when /readyz says ready, else 0.")
    ready.add(Labels.of(), 0 if health.problems() else 1)
    up = gauge(
        "upstream_up",
        "1 when the upstream answered its latest check (a memcached VERSION), 0 when it did"
        " not; absent until the first check ends.",
    )
    since = gauge(
        "upstream_state_since_seconds",
        "Unix time the upstream last became reachable or unreachable.",
        "seconds",
    )
    for upstream in health.upstreams.values():
        if upstream.reachable is None:
            continue
        labels = Labels.of(option=upstream.option, upstream=upstream.address)
        up.add(labels, 1 if upstream.reachable else 0)
        since.add(labels, upstream.since)
    return [ready, up, since]


def gateway_families(view: StatsView, *, per_vbucket: bool = False) -> list[Family]:
    """Every metric family of one scrape of ``view``."""
    streams = figures_by_stream(view, per_vbucket=per_vbucket)
    from gateway.metrics.listeners import listener_families

    return [
        build_info(),
        *process_families(view, per_vbucket=per_vbucket),
        *stream_families(streams, per_vbucket=per_vbucket),
        *listener_families(view.listeners),
    ]
