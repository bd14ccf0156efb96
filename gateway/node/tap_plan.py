"""What a TAP CONNECT asks of the node, resolved against the store: a cursor per vbucket.

Theory of operation. ``plan_stream`` reads the CONNECT once, at connect
time; which vbuckets it streams and how each starts (a registered client's
position, DUMP, CHECKPOINT, BACKFILL, live) are ``adapters.tap.plan``'s
rules, shared with the TAP front (a listed vbucket the store lacks is
skipped, with a log line, as 2.x did). What is the node's own is the cursor: a
registered client resumes an unfinished backfill, or streams live from its
seqno while the store still keeps checkpoints from there on; a CHECKPOINT
client goes live from the end of its last closed checkpoint if the store
still knows every checkpoint after it. Whenever a resume point is no longer
available the vbucket falls back to a full backfill that starts with
OPAQUE(INITIAL_VBUCKET_STREAM), so the receiver resets it first.

The store keeps each key once, at its latest by_seqno, so "everything after
seqno S" is exactly what a client holding S lacks: backfill and live
streaming both read ``items_since``, and a position is just a seqno.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from adapters.tap import ConnectFlags, TapConnect
from adapters.tap.connect import ConnectView
from adapters.tap.plan import Start, connect_vbuckets, skipped_vbuckets, start_of
from gateway.node.items import VBucketState
from gateway.node.tap_registry import Registration, VbPosition

log = logging.getLogger(__name__)


class Phase(Enum):
    BACKFILL = auto()
    LIVE = auto()
    DONE = auto()


@dataclass(slots=True)
class VbCursor:
    """One vbucket of a stream: how far it has been sent and what comes next."""

    vb: int
    seqno: int
    """Every latest version up to this by_seqno has been sent."""
    phase: Phase
    reset: bool = False
    """Send OPAQUE(INITIAL_VBUCKET_STREAM) before the backfill."""
    checkpoint: int | None = None
    """The checkpoint whose START went out and whose END has not."""
    backfill_end: int = 0


@dataclass(frozen=True, slots=True)
class StreamPlan(ConnectView):
    name: str
    flags: ConnectFlags
    cursors: tuple[VbCursor, ...]


def plan_stream(
    connect: TapConnect,
    name: str,
    store: Any,
    registration: Registration | None,
    now: float,
) -> StreamPlan:
    """Resolve ``connect`` into per-vbucket cursors (see the module docstring)."""
    active = (vb for vb in range(store.n_vbuckets) if store.state(vb) is VBucketState.ACTIVE)
    vbuckets = connect_vbuckets(connect, range(store.n_vbuckets), active)
    for vb in skipped_vbuckets(connect, range(store.n_vbuckets)):
        # As 2.x registerCursor: "VBucket %d not found for TAP cursor. Skip it..."
        log.warning("%s: vbucket %d not found for the TAP cursor, skipped", name, vb)
    checkpoints = dict(connect.checkpoints)
    positions = registration.positions if registration is not None else {}
    cursors = []
    for vb in vbuckets:
        start = start_of(connect, vb, registered=positions, checkpoints=checkpoints, now=now)
        cursors.append(_cursor(vb, start, store, positions.get(vb), checkpoints.get(vb)))
    return StreamPlan(name, connect.connect_flags, tuple(cursors))


def full_backfill(vb: int, *, reset: bool = True) -> VbCursor:
    return VbCursor(vb, 0, Phase.BACKFILL, reset=reset)


def _cursor(
    vb: int, start: Start, store: Any, position: VbPosition | None, checkpoint: int | None
) -> VbCursor:
    if start is Start.RESUME:
        assert position is not None
        return _resume_registered(vb, position, store)
    if start is Start.CHECKPOINT:
        assert checkpoint is not None
        after = resume_after_checkpoint(store, vb, checkpoint)
        return full_backfill(vb) if after is None else VbCursor(vb, after, Phase.LIVE)
    if start is Start.LIVE:
        return VbCursor(vb, store.high_seqno(vb), Phase.LIVE)
    return full_backfill(vb)  # DUMP, BACKFILL


def _resume_registered(vb: int, position: VbPosition, store: Any) -> VbCursor:
    high = store.high_seqno(vb)
    if position.seqno > high:
        return full_backfill(vb)  # the vbucket went back (reset, rollback): start over
    if not position.backfill_done:
        return VbCursor(vb, position.seqno, Phase.BACKFILL)
    if store.checkpoint_of(vb, position.seqno + 1) is None:
        return full_backfill(vb)
    return VbCursor(vb, position.seqno, Phase.LIVE)


def resume_after_checkpoint(store: Any, vb: int, checkpoint_id: int) -> int | None:
    """The seqno after which a client whose last closed checkpoint is ``checkpoint_id``
    continues; ``None`` if the store can no longer tell (backfill instead).

    Checkpoint ids grow with seqnos but may skip numbers, so a client is safe
    to resume when the oldest checkpoint kept is at most one past its own:
    every checkpoint the store forgot then came before or was the client's.
    """
    listing = store.checkpoints(vb)
    if not listing or checkpoint_id >= listing[-1].id:
        return None  # a checkpoint this vbucket has not closed: another history
    if listing[0].id > checkpoint_id + 1:
        return None
    for cp in listing:
        if cp.id > checkpoint_id:
            return int(cp.start_seqno) - 1
    return None
