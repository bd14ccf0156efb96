"""``/status.json``: what the status page shows, from a ``StatsView`` and ``Health``.

Per front: where it listens and its upstream's state. Per stream (downstream
connection): items sent, lag in items (sent and acked) and in seconds (the
oldest item not yet acknowledged, and the time since the last item sent),
and, per vbucket that is backfilling, its progress and an ETA. The ETA comes
from the average rate since the backfill was first seen by this endpoint:
``BackfillTracker`` remembers (time, seqno) of each backfilling vbucket and
forgets it once the backfill ends, so it holds no more than the vbuckets
backfilling now.

Built in a worker thread (the per-vbucket walk over thousands of streams
must not stall the fronts), like a scrape.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from gateway.metrics.view import StatsView, StreamKey, figures_by_stream
from gateway.runtime.version import python_version, version

STALLED_AFTER = 5.0
"""Seconds a backfill seen without progress is called stalled rather than estimated."""
MAX_BACKFILL_ROWS = 64
"""Per stream; the rest are counted (``backfills_not_shown``), not listed."""


class BackfillTracker:
    """First sighting (time, sent seqno) of every vbucket backfilling now."""

    def __init__(self) -> None:
        self._first: dict[tuple[StreamKey, int], tuple[float, int]] = {}
        self._lock = threading.Lock()  # two pages polling at once render in parallel

    def rate_and_eta(
        self, seen: dict[tuple[StreamKey, int], tuple[int, int]], now: float
    ) -> dict[tuple[StreamKey, int], tuple[float | None, float | None, bool]]:
        """Items/s, seconds left and whether it is stalled, for each
        (stream, vbucket) -> (sent, remaining) backfilling now."""
        out: dict[tuple[StreamKey, int], tuple[float | None, float | None, bool]] = {}
        with self._lock:
            first = {key: self._first.get(key, (now, sent)) for key, (sent, _) in seen.items()}
            self._first = first
        for key, (sent, remaining) in seen.items():
            since, start = first[key]
            elapsed = now - since
            if elapsed <= 0 or sent <= start:
                out[key] = (None, None, elapsed >= STALLED_AFTER)
                continue
            rate = (sent - start) / elapsed
            out[key] = (rate, remaining / rate, False)
        return out


def status(
    view: StatsView, health: dict[str, Any] | None, tracker: BackfillTracker
) -> dict[str, Any]:
    """The whole ``/status.json`` document; ``health`` is ``Health.snapshot``."""
    now = view.now
    figures = figures_by_stream(view, per_vbucket=True)
    backfilling: dict[tuple[StreamKey, int], tuple[int, int]] = {}
    ends: dict[tuple[StreamKey, int], int] = {}
    for key, fig in figures.items():
        for vb, row in fig.rows.items():
            if row.backfilling:
                backfilling[key, vb] = (row.sent_seqno, row.backfill_remaining)
                ends[key, vb] = row.sent_seqno + row.backfill_remaining
    estimates = tracker.rate_and_eta(backfilling, now)
    streams = []
    for key, fig in figures.items():
        direction, connection, upstream = key
        rows = []
        for vb in sorted(fig.rows):
            row = fig.rows[vb]
            if not row.backfilling:
                continue
            end = ends[key, vb]
            rate, eta, stalled = estimates[key, vb]
            rows.append({
                "vbucket": vb,
                "sent_seqno": row.sent_seqno,
                "end_seqno": end,
                "remaining": row.backfill_remaining,
                "percent": round(100.0 * row.sent_seqno / end, 1) if end else 100.0,
                "items_per_second": None if rate is None else round(rate, 1),
                "eta_seconds": None if eta is None else round(eta, 1),
                "stalled": stalled,
            })  # fmt: skip
        streams.append({
            "direction": direction,
            "connection": connection,
            "upstream": upstream,
            "vbuckets": fig.vbuckets,
            "items_sent": sum(fig.items_sent.values()),
            "bytes_sent": fig.bytes_sent,
            "send_lag_items": fig.send_lag,
            "ack_lag_items": fig.ack_lag,
            "ack_lag_seconds": round(fig.oldest_unacked_age, 3),
            "since_last_item_seconds": (
                round(max(0.0, now - fig.last_item_time), 3) if fig.last_item_time else None
            ),
            "connected_seconds": round(max(0.0, now - fig.created), 1) if fig.created else None,
            "backfill_remaining": fig.backfill_remaining,
            "backfilling_vbuckets": fig.backfilling_vbuckets,
            "backfills": rows[:MAX_BACKFILL_ROWS],
            "backfills_not_shown": max(0, len(rows) - MAX_BACKFILL_ROWS),
        })  # fmt: skip
    doc: dict[str, Any] = {
        "version": version(),
        "python": python_version(),
        "now": now,
        "streams": streams,
        "fronts": [],
    }
    if health is not None:
        doc.update(health)
        for front in doc["fronts"]:
            direction = front["direction"]
            front["connections"] = sum(1 for s in streams if s["direction"] == direction)
    return doc


def status_json(view: StatsView, health: dict[str, Any] | None, tracker: BackfillTracker) -> bytes:
    return json.dumps(status(view, health, tracker), separators=(",", ":")).encode()
