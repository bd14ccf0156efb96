"""What a TAP CONNECT asks for, resolved against the store: a plan per vbucket.

Theory of operation. ``plan_stream`` reads the CONNECT flags once, at
connect time, and decides for every vbucket of the stream where it starts,
in this order of precedence (as ep-engine 2.x did):

1. a registered client that already holds a position in the vbucket resumes
   there: it continues an unfinished backfill, or streams live from its
   seqno while the store still keeps checkpoints from there on;
2. DUMP: a backfill of everything (wrapped like any backfill), then
   nothing live;
3. CHECKPOINT with an entry for the vbucket: live from the end of the
   client's last closed checkpoint, if the store still knows every
   checkpoint after it;
4. BACKFILL with a date now or in the past (0 included): everything;
   a date in the future (all ones, say): only new changes;
5. otherwise only new changes, from the current high seqno.

Whenever a resume point is no longer available the vbucket falls back to a
full backfill that starts with OPAQUE(INITIAL_VBUCKET_STREAM), so the
receiver resets it first. The vbuckets are the listed ones (LIST_VBUCKETS
with a non-empty list) or every vbucket ACTIVE at connect time. Unknown
flag bits are ignored (see ``adapters.tap.connect``). A CONNECT the node
cannot honour (a vbucket out of range, TAKEOVER without a list) raises
``ProtocolError`` with status NOT_SUPPORTED.

The store keeps each key once, at its latest by_seqno, so "everything after
seqno S" is exactly what a client holding S lacks: backfill and live
streaming both read ``items_since``, and a position is just a seqno.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from adapters.tap import ConnectFlags, TapConnect
from adapters.tap.connect import ConnectView, connect_refusal, listed_vbuckets
from gateway.node.items import VBucketState
from gateway.node.tap_registry import Registration, VbPosition


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


def stream_vbuckets(connect: TapConnect, store: Any) -> tuple[int, ...]:
    """The listed vbuckets (in order, once each), or every ACTIVE one."""
    if not listed_vbuckets(connect):
        return tuple(vb for vb in range(store.n_vbuckets) if store.state(vb) is VBucketState.ACTIVE)
    for vb in connect.vbuckets:
        if vb >= store.n_vbuckets:
            raise connect_refusal("no such vbucket", field="vbuckets", value=vb)
    return tuple(dict.fromkeys(connect.vbuckets))


def plan_stream(
    connect: TapConnect,
    name: str,
    store: Any,
    registration: Registration | None,
    now: float,
) -> StreamPlan:
    """Resolve ``connect`` into per-vbucket cursors (see the module docstring)."""
    vbuckets = stream_vbuckets(connect, store)
    for vb, _ in connect.checkpoints:
        if vb >= store.n_vbuckets:
            raise connect_refusal("no such vbucket", field="checkpoints", value=vb)
    checkpoints = dict(connect.checkpoints)
    cursors = tuple(
        _cursor(vb, connect, store, registration, checkpoints.get(vb), now) for vb in vbuckets
    )
    return StreamPlan(name, connect.connect_flags, cursors)


def full_backfill(vb: int, *, reset: bool = True) -> VbCursor:
    return VbCursor(vb, 0, Phase.BACKFILL, reset=reset)


def _cursor(
    vb: int,
    connect: TapConnect,
    store: Any,
    registration: Registration | None,
    checkpoint: int | None,
    now: float,
) -> VbCursor:
    flags = connect.connect_flags
    position = registration.positions.get(vb) if registration is not None else None
    if position is not None:
        return _resume_registered(vb, position, store)
    if flags & ConnectFlags.DUMP:
        return full_backfill(vb)
    if flags & ConnectFlags.CHECKPOINT and checkpoint is not None:
        after = resume_after_checkpoint(store, vb, checkpoint)
        return full_backfill(vb) if after is None else VbCursor(vb, after, Phase.LIVE)
    if flags & ConnectFlags.BACKFILL and (connect.backfill_date or 0) <= now:
        return full_backfill(vb)
    return VbCursor(vb, store.high_seqno(vb), Phase.LIVE)


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
