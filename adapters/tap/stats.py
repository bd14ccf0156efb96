"""The ``STAT tap`` group: one list of names, in ep-engine 2.x's spelling and order.

Both producers of TAP streams here answer ``STAT tap``: the reference node
and the TAP front. Each supplies the figures it has; ``tap_stat_pairs`` lays
them out under one list of names (``tap_group``), so the two cannot drift
apart. A name
missing from the list is a bug (``KeyError``), not a new stat.

Process totals are ``ep_tap_<stat>`` (ep-engine 2.x ep_engine.cc
``doTapStats``: ``ep_tap_count``, ``ep_tap_total_fetched``, ...); each
connection's are ``eq_tapq:<name>:<stat>`` (tapconnection.cc
``TapProducer::addStats``). Per connection:

- ``type`` producer, ``created`` (epoch seconds), ``connected``,
  ``upstream`` (the TAP front only: the node it reads from), ``flags`` (the
  CONNECT flags by name), ``supports_ack``, ``registered``, ``reconnects``
  (registered clients), ``vb_filters`` (vbuckets streamed);
- ``qlen`` and ``total_backlog_size``: items still to send;
  ``backfill_remaining`` (the TAP front's backfill still to come);
- ``rec_fetched`` items sent, ``num_deletes`` of which deletes,
  ``num_checkpoint_end``, ``total_noops``;
- ``idle`` (caught up, nothing unacked), ``pending_backfill``,
  ``backfill_completed``, ``paused`` (backing off after a busy nack);
- acks: ``ack_seqno`` (last sequence number sent), ``recv_ack_seqno`` (last
  acked), ``ack_log_size`` and ``num_unacked`` (messages not yet acked),
  ``ack_window_full``, ``num_tap_nack``, ``num_tap_tmpfail_survivors``
  (messages resent after a busy nack).
"""

from __future__ import annotations

from collections.abc import Mapping

from adapters.tap import ConnectFlags

Pairs = list[tuple[str, str]]
Figures = Mapping[str, object]
"""Stat name (without prefix) to value; bools print as ``true``/``false``."""

TOTALS: tuple[str, ...] = (
    "count",
    "total_fetched",
    "total_backlog_size",
    "queue_backfillremaining",
    "deletes",
    "ack_interval",
    "ack_window_size",
    "backoff_period",
    "noop_interval",
)
"""``ep_tap_<stat>``, in the order they are answered."""

CONNECTION: tuple[str, ...] = (
    "type",
    "created",
    "connected",
    "upstream",
    "flags",
    "supports_ack",
    "registered",
    "reconnects",
    "vb_filters",
    "qlen",
    "total_backlog_size",
    "backfill_remaining",
    "rec_fetched",
    "num_deletes",
    "num_checkpoint_end",
    "total_noops",
    "idle",
    "pending_backfill",
    "backfill_completed",
    "paused",
    "ack_seqno",
    "recv_ack_seqno",
    "ack_log_size",
    "num_unacked",
    "ack_window_full",
    "num_tap_nack",
    "num_tap_tmpfail_survivors",
)
"""``eq_tapq:<name>:<stat>``, in the order they are answered."""

_TOTAL_RANK = {name: rank for rank, name in enumerate(TOTALS)}
_CONNECTION_RANK = {name: rank for rank, name in enumerate(CONNECTION)}


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _ordered(figures: Figures, rank: Mapping[str, int]) -> list[tuple[str, object]]:
    return sorted(figures.items(), key=lambda pair: rank[pair[0]])


def tap_group(totals: Figures, connections: Mapping[str, Figures]) -> Pairs:
    """``STAT tap``: the totals, then each connection (in the order given)."""
    out: Pairs = [(f"ep_tap_{stat}", _text(v)) for stat, v in _ordered(totals, _TOTAL_RANK)]
    for name, figures in connections.items():
        out.extend(connection_pairs(name, figures))
    return out


def connection_pairs(name: str, figures: Figures) -> Pairs:
    """One connection's ``eq_tapq:<name>:<stat>`` lines."""
    return [
        (f"eq_tapq:{name}:{stat}", _text(value))
        for stat, value in _ordered(figures, _CONNECTION_RANK)
    ]


def flag_names(flags: ConnectFlags) -> str:
    """The ``flags`` stat: the CONNECT flags by name (``none`` without any)."""
    return ",".join(f.name.lower() for f in ConnectFlags if f.name and flags & f) or "none"


def seconds(value: float) -> str:
    """A duration as 2.x printed its settings: whole seconds without a fraction."""
    return str(int(value)) if float(value).is_integer() else str(value)
