"""``STAT tap`` and ``STAT upr`` (alias ``dcp``) of the gateway's own ports.

The names are those 2.x and 3.0 operators and tools already read, spelled as
the reference node spells them (``adapters.tap.stats``,
``gateway.node.upr_hub``): process totals ``ep_tap_*`` and ``ep_dcp_*`` (with
the pre-release ``ep_upr_*`` aliases), then per connection
``eq_tapq:<name>:<stat>`` and ``eq_dcpq:<name>:<stat>`` / ``eq_uprq:<name>:<stat>``.

A few figures the nodes never had are added under the same prefixes where an
operator would look for them: ``upstream`` (the node the gateway reads from)
and ``backfill_remaining``. Both groups read the same ``GatewayStats`` as
the Prometheus collector, so the two views always agree. They run on the
trio thread, the one that updates the stats.
"""

from __future__ import annotations

import time

from adapters.tap.stats import tap_group
from gateway.metrics.figures import TAP_FRONT, UPR_FRONT, GatewayStats
from gateway.metrics.view import StreamFigures, stream_figures

Pairs = list[tuple[str, str]]

DATA_KINDS = ("mutation", "deletion", "expiration")
"""What 2.x and 3.0 count as items (``rec_fetched``, ``items_sent``): no markers."""


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _items(fig: StreamFigures) -> int:
    return sum(fig.items_sent.get(kind, 0) for kind in DATA_KINDS)


def _deletes(fig: StreamFigures) -> int:
    # TAP has one delete message for both; 2.x counted expirations as deletes.
    return fig.items_sent.get("deletion", 0) + fig.items_sent.get("expiration", 0)


def _by_name(
    stats: GatewayStats, direction: str, now: float, *, per_vbucket: bool
) -> list[tuple[str, str, StreamFigures]]:
    """(name, upstream, figures) of the live connections, one entry per name."""
    merged: dict[str, tuple[str, StreamFigures]] = {}
    for stream in stats.active(direction):
        fig = stream_figures(stream, now, per_vbucket=per_vbucket)
        found = merged.get(stream.connection)
        if found is None:
            merged[stream.connection] = (stream.upstream, fig)
        else:
            found[1].merge(fig)
    return [(name, *merged[name]) for name in sorted(merged)]


def tap_stat_pairs(stats: GatewayStats, *, now: float | None = None) -> Pairs:
    """The ``STAT tap`` group of the TAP front (the names: ``adapters.tap.stats``)."""
    conns = _by_name(stats, TAP_FRONT, time.time() if now is None else now, per_vbucket=False)
    closed = stats.closed_items_sent
    closed_items = sum(closed[TAP_FRONT, kind] for kind in DATA_KINDS)
    closed_deletes = closed[TAP_FRONT, "deletion"] + closed[TAP_FRONT, "expiration"]
    totals: dict[str, object] = {
        "count": len(conns),
        "total_fetched": closed_items + sum(_items(f) for _, _, f in conns),
        "total_backlog_size": sum(f.send_lag for _, _, f in conns),
        "queue_backfillremaining": sum(f.backfill_remaining for _, _, f in conns),
        "deletes": closed_deletes + sum(_deletes(f) for _, _, f in conns),
    }
    figures: dict[str, dict[str, object]] = {}
    for name, upstream, fig in conns:
        figures[name] = {
            "type": "producer",
            "created": int(fig.created),
            "connected": True,
            "upstream": upstream,
            "supports_ack": fig.ack_window > 0,
            "vb_filters": fig.vbuckets,
            "qlen": fig.send_lag,
            "total_backlog_size": fig.send_lag,
            "backfill_remaining": fig.backfill_remaining,
            "rec_fetched": _items(fig),
            "num_deletes": _deletes(fig),
            "idle": fig.send_lag == 0 and fig.acks_pending == 0,
            "pending_backfill": fig.backfilling_vbuckets > 0,
            "backfill_completed": fig.backfilling_vbuckets == 0,
            "ack_log_size": fig.acks_pending,
            "num_unacked": fig.acks_pending,
            "ack_window_full": _window_full(fig),
            "num_tap_nack": fig.nacks_total,
            "num_tap_tmpfail_survivors": fig.retransmits_total,
        }
    return tap_group(totals, figures)


def _window_full(fig: StreamFigures) -> bool:
    return fig.ack_window > 0 and fig.acks_pending >= fig.ack_window


def upr_stat_pairs(stats: GatewayStats, *, now: float | None = None) -> Pairs:
    """The ``STAT upr`` (and ``STAT dcp``) group of the UPR front."""
    conns = _by_name(stats, UPR_FRONT, time.time() if now is None else now, per_vbucket=True)
    totals: list[tuple[str, int]] = [
        ("count", len(conns)),
        ("producer_count", len(conns)),
        ("consumer_count", 0),
        ("total_bytes", sum(f.bytes_sent for _, _, f in conns)),
        ("items_sent", sum(_items(f) for _, _, f in conns)),
        ("items_remaining", sum(f.send_lag for _, _, f in conns)),
    ]
    per_connection: Pairs = []
    for name, upstream, fig in conns:
        flow_control = fig.buffer_size > 0
        values: list[tuple[str, object]] = [
            ("type", "producer"),
            ("created", int(fig.created)),
            ("upstream", upstream),
            ("items_sent", _items(fig)),
            ("items_remaining", fig.send_lag),
            ("backfill_remaining", fig.backfill_remaining),
            ("total_bytes_sent", fig.bytes_sent),
            ("unacked_bytes", fig.unacked_bytes),
            ("max_buffer_bytes", fig.buffer_size),
            ("flow_control", "enabled" if flow_control else "disabled"),
            ("paused", _bool(flow_control and fig.unacked_bytes >= fig.buffer_size)),
            ("num_streams", fig.vbuckets),
        ]
        for vb in sorted(fig.rows):
            row = fig.rows[vb]
            values += [
                (f"stream_{vb}_state", "backfilling" if row.backfilling else "in-memory"),
                (f"stream_{vb}_last_sent_seqno", row.sent_seqno),
                (f"stream_{vb}_items_remaining", row.send_lag),
                (f"stream_{vb}_backfill_remaining", row.backfill_remaining),
            ]
        per_connection.extend((f"{name}:{stat}", str(value)) for stat, value in values)
    out: Pairs = [(f"ep_dcp_{stat}", str(value)) for stat, value in totals]
    out.extend((f"eq_dcpq:{key}", value) for key, value in per_connection)
    # Pre-release names, still read by tools written against 3.0 betas.
    out.extend((f"ep_upr_{stat}", str(value)) for stat, value in totals)
    out.extend((f"eq_uprq:{key}", value) for key, value in per_connection)
    return out
