"""STAT names of a TAP producer connection, in ep-engine 2.x's spelling.

Per connection (``eq_tapq:<name>:<stat>``, the prefix added by the hub):

- ``type`` producer, ``created`` (epoch seconds), ``connected`` true,
  ``flags`` (the CONNECT flags by name), ``supports_ack``, ``registered``,
  ``reconnects`` (registered clients), ``vb_filters`` (vbuckets streamed);
- ``qlen`` and ``total_backlog_size``: items still to send (an upper bound:
  seqnos not yet sent, counting versions since overwritten);
- ``rec_fetched`` items sent, ``num_deletes`` of which deletes,
  ``num_checkpoint_end``, ``total_noops``;
- ``idle`` (caught up, nothing unacked), ``pending_backfill``,
  ``backfill_completed``, ``paused`` (backing off after a busy nack);
- acks: ``ack_seqno`` (last sequence number sent), ``recv_ack_seqno`` (last
  acked), ``ack_log_size`` and ``num_unacked`` (messages not yet acked),
  ``ack_window_full``, ``num_tap_nack``, ``num_tap_tmpfail_survivors``
  (messages resent after a busy nack).

``vbucket-takeover <vb> <name>`` (2.x: ``tap-vbtakeover``): ``name``,
``status`` (backfilling, in-memory or done), ``estimate`` (exact count of
items still to send), ``backfill_remaining``, ``chk_items`` (the rest:
items from checkpoints), ``vb_items`` (live items in the vbucket).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.tap import ConnectFlags
from adapters.tap.producer import ProducerState
from gateway.node.tap_plan import Phase, VbCursor

if TYPE_CHECKING:
    from gateway.node.tap_producer import TapStream


def _bool(value: bool) -> str:
    return "true" if value else "false"


def flag_names(flags: ConnectFlags) -> str:
    return ",".join(f.name.lower() for f in ConnectFlags if f.name and flags & f) or "none"


def connection_stats(stream: TapStream) -> list[tuple[str, str]]:
    producer = stream.producer
    plan = stream.plan
    backfilling = any(c.phase is Phase.BACKFILL for c in plan.cursors)
    remaining = stream.items_remaining
    registration = stream.registration
    reconnects = registration.connections - 1 if registration is not None else 0
    pairs: list[tuple[str, object]] = [
        ("type", "producer"),
        ("created", int(stream.created)),
        ("connected", _bool(True)),
        ("flags", flag_names(plan.flags)),
        ("supports_ack", _bool(plan.support_ack)),
        ("registered", _bool(plan.registered)),
        ("reconnects", reconnects),
        ("vb_filters", len(plan.cursors)),
        ("qlen", remaining),
        ("total_backlog_size", remaining),
        ("rec_fetched", stream.items_sent),
        ("num_deletes", stream.deletes_sent),
        ("num_checkpoint_end", stream.checkpoint_ends),
        ("total_noops", stream.noops_sent),
        ("idle", _bool(stream.idle)),
        ("pending_backfill", _bool(backfilling)),
        ("backfill_completed", _bool(not backfilling)),
        ("paused", _bool(producer.state is ProducerState.BACKING_OFF)),
        ("ack_seqno", stream.last_stamped),
        ("recv_ack_seqno", stream.last_acked),
        ("ack_log_size", producer.unacked),
        ("num_unacked", producer.unacked),
        ("ack_window_full", _bool(producer.unacked >= producer.max_unacked)),
        ("num_tap_nack", producer.nacks_total),
        ("num_tap_tmpfail_survivors", producer.retransmits_total),
    ]
    return [(name, str(value)) for name, value in pairs]


def takeover_stats(stream: TapStream, cursor: VbCursor) -> dict[str, str]:
    store = stream.store
    vb = cursor.vb
    left = len(store.items_since(vb, cursor.seqno))
    backfill_left = 0
    if cursor.phase is Phase.BACKFILL:
        # Not started yet (end 0): the backfill will reach the high seqno of its start.
        end = cursor.backfill_end or None
        backfill_left = len(store.items_since(vb, cursor.seqno, end))
        status = "backfilling"
    else:
        status = "done" if cursor.phase is Phase.DONE else "in-memory"
    return {
        "name": f"eq_tapq:{stream.name}",
        "status": status,
        "estimate": str(left),
        "backfill_remaining": str(backfill_left),
        "chk_items": str(left - backfill_left),
        "vb_items": str(store.vbucket_stats(vb).items),
    }
