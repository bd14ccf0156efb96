"""The figures of a TAP producer connection of the node, for ``STAT tap``.

The names and their order are ``adapters.tap.stats`` (one list for the node
and the TAP front); here each gets its value. ``vbucket-takeover <vb> <name>``
(2.x: ``tap-vbtakeover``): ``name``, ``status`` (backfilling, in-memory or
done), ``estimate`` (exact count of items still to send),
``backfill_remaining``, ``chk_items`` (the rest: items from checkpoints),
``vb_items`` (live items in the vbucket). ``qlen`` and ``total_backlog_size``
are an upper bound: seqnos not yet sent, counting versions since overwritten.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.tap.producer import ProducerState
from adapters.tap.stats import flag_names
from gateway.node.tap_plan import Phase, VbCursor

if TYPE_CHECKING:
    from gateway.node.tap_producer import TapStream


def connection_figures(stream: TapStream) -> dict[str, object]:
    producer = stream.producer
    plan = stream.plan
    backfilling = any(c.phase is Phase.BACKFILL for c in plan.cursors)
    remaining = stream.items_remaining
    registration = stream.registration
    reconnects = registration.connections - 1 if registration is not None else 0
    return {
        "type": "producer",
        "created": int(stream.created),
        "connected": True,
        "flags": flag_names(plan.flags),
        "supports_ack": plan.support_ack,
        "registered": plan.registered,
        "reconnects": reconnects,
        "vb_filters": len(plan.cursors),
        "qlen": remaining,
        "total_backlog_size": remaining,
        "rec_fetched": stream.items_sent,
        "num_deletes": stream.deletes_sent,
        "num_checkpoint_end": stream.checkpoint_ends,
        "total_noops": stream.noops_sent,
        "idle": stream.idle,
        "pending_backfill": backfilling,
        "backfill_completed": not backfilling,
        "paused": producer.state is ProducerState.BACKING_OFF,
        "ack_seqno": stream.last_stamped,
        "recv_ack_seqno": stream.last_acked,
        "ack_log_size": producer.unacked,
        "num_unacked": producer.unacked,
        "ack_window_full": producer.unacked >= producer.max_unacked,
        "num_tap_nack": producer.nacks_total,
        "num_tap_tmpfail_survivors": producer.retransmits_total,
    }


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
