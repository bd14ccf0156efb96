"""What a TAP CONNECT asks of the TAP front, resolved against the upstream UPR node.

Theory of operation. ``plan_connection`` reads the CONNECT once; which
vbuckets it streams (listed, or every ACTIVE one upstream) and how each
starts (a registered client's position, DUMP, CHECKPOINT, BACKFILL, live)
are ``adapters.tap.plan``'s rules, shared with the reference node. What is
the front's own is the UPR stream request that serves each vbucket:

- RESUME: the upstream uuid, seqno and snapshot range the client last
  acknowledged (its open backfill, if any, continues);
- DUMP: everything up to the high seqno at connect, wrapped like any
  backfill, then the stream ends (an empty or non-ACTIVE vbucket sends
  nothing, as 2.x dumped only ACTIVE vbuckets holding items);
- CHECKPOINT: from where the gateway saw the client's last closed
  checkpoint end, if it still knows;
- BACKFILL: everything; LIVE: from the current high seqno.

A vbucket whose resume point is unknown falls back to a full backfill that
starts with OPAQUE(INITIAL_VBUCKET_STREAM), so the client resets it first;
so does one the upstream answers with a rollback (the session's business).
A listed vbucket the upstream lacks is skipped, as 2.x skipped one it did
not hold, and named in ``skipped`` (the session counts it as lost). A
CONNECT the gateway cannot honour raises ``ProtocolError`` (status
NOT_SUPPORTED).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapters.tap import ConnectFlags, TapConnect
from adapters.tap.connect import ConnectView
from adapters.tap.plan import Start, connect_vbuckets, skipped_vbuckets, start_of
from gateway.fronts.tap.registry import VbResume

MAX_SEQNO = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class UpstreamVbucket:
    """One vbucket as the upstream node reports it (``STAT vbucket``/``vbucket-seqno``)."""

    vbucket: int
    active: bool
    uuid: int
    high_seqno: int


@dataclass(frozen=True, slots=True)
class VbStart:
    """The stream request that serves one vbucket, and how its first snapshot reads."""

    vbucket: int
    start_seqno: int = 0
    end_seqno: int = MAX_SEQNO
    uuid: int = 0
    snap_start: int = 0
    snap_end: int = 0
    backfill: bool = False
    """The first snapshot is a backfill wrapped in OPAQUE(INITIAL_VBUCKET_STREAM)."""
    resumed: bool = False
    """Continues a registered client's position (its open backfill, if any)."""

    @classmethod
    def full(cls, vbucket: int, *, end: int = MAX_SEQNO) -> VbStart:
        return cls(vbucket, end_seqno=end, backfill=True)

    @classmethod
    def from_resume(cls, vbucket: int, position: VbResume) -> VbStart:
        return cls(
            vbucket,
            start_seqno=position.seqno,
            uuid=position.uuid,
            snap_start=position.snap_start,
            snap_end=position.snap_end,
            backfill=not position.backfill_done,
            resumed=True,
        )


@dataclass(frozen=True, slots=True)
class ConnectionPlan(ConnectView):
    name: str
    flags: ConnectFlags
    starts: tuple[VbStart, ...]
    skipped: tuple[int, ...] = ()
    """Listed vbuckets the upstream does not have."""


def plan_connection(
    connect: TapConnect,
    name: str,
    upstream: dict[int, UpstreamVbucket],
    *,
    registered: dict[int, VbResume] | None,
    checkpoint_ends: dict[tuple[int, int], VbResume],
    now: float,
) -> ConnectionPlan:
    """Resolve ``connect`` (see the module docstring).

    ``checkpoint_ends`` maps (vbucket, checkpoint id) to where that
    checkpoint ended, for clients that resume with the CHECKPOINT flag.
    """
    active = (vb for vb, state in sorted(upstream.items()) if state.active)
    vbuckets = connect_vbuckets(connect, upstream, active)
    checkpoints = dict(connect.checkpoints)
    registered = registered or {}
    starts = []
    for vb in vbuckets:
        state = upstream[vb]
        start = start_of(connect, vb, registered=registered, checkpoints=checkpoints, now=now)
        if start is Start.RESUME:
            starts.append(VbStart.from_resume(vb, registered[vb]))
        elif start is Start.DUMP:
            # 2.x dumped ACTIVE vbuckets that hold items; an empty stream sends nothing.
            starts.append(VbStart.full(vb, end=state.high_seqno if state.active else 0))
        elif start is Start.CHECKPOINT:
            ended = checkpoint_ends.get((vb, checkpoints[vb]))
            starts.append(VbStart.full(vb) if ended is None else VbStart.from_resume(vb, ended))
        elif start is Start.BACKFILL:
            starts.append(VbStart.full(vb))
        else:
            high = state.high_seqno
            starts.append(VbStart(vb, high, uuid=state.uuid, snap_start=high, snap_end=high))
    skipped = skipped_vbuckets(connect, upstream)
    return ConnectionPlan(name, connect.connect_flags, tuple(starts), skipped)
