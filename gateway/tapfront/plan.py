"""What a TAP CONNECT asks of the TAP front, resolved against the upstream UPR node.

Theory of operation. ``plan_connection`` reads the CONNECT once and decides,
for every vbucket, the UPR stream request that serves it, in the order of
precedence a 2.x server used:

1. a registered client that holds a position in the vbucket resumes there
   (same upstream uuid, seqno and snapshot range it last acknowledged);
2. DUMP: everything up to the high seqno at connect, wrapped like any
   backfill, then the stream ends (an empty or non-ACTIVE vbucket sends
   nothing, as 2.x dumped only ACTIVE vbuckets holding items);
3. CHECKPOINT with an entry for the vbucket: after the last closed
   checkpoint the client names, if the gateway still knows where it ended;
4. BACKFILL with a date now or in the past (0 included): everything; a date
   in the future (all ones, say): only new changes;
5. otherwise only new changes, from the current high seqno.

A vbucket whose resume point is unknown falls back to a full backfill that
starts with OPAQUE(INITIAL_VBUCKET_STREAM), so the client resets it first;
so does one the upstream answers with a rollback (the session's business).
The vbuckets are the listed ones (a list of none means all) or every ACTIVE
vbucket upstream; unknown flag bits are ignored (see ``adapters.tap.connect``).
A CONNECT the gateway cannot honour raises ``ProtocolError`` (status
NOT_SUPPORTED).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapters.tap import ConnectFlags, TapConnect
from adapters.tap.connect import ConnectView, connect_refusal, listed_vbuckets
from gateway.tapfront.registry import VbResume

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
    flags = connect.connect_flags
    listed = listed_vbuckets(connect)
    if flags & ConnectFlags.TAKEOVER_VBUCKETS and flags & ConnectFlags.DUMP:
        raise connect_refusal(
            "TAKEOVER_VBUCKETS and DUMP exclude each other", field="flags", value=int(flags)
        )
    if listed:
        for vb in connect.vbuckets:
            if vb not in upstream:
                raise connect_refusal("no such vbucket upstream", field="vbuckets", value=vb)
        vbuckets = tuple(dict.fromkeys(connect.vbuckets))
    else:
        vbuckets = tuple(vb for vb, state in sorted(upstream.items()) if state.active)
    for vb, _ in connect.checkpoints:
        if vb not in upstream:
            raise connect_refusal("no such vbucket upstream", field="checkpoints", value=vb)
    checkpoints = dict(connect.checkpoints)
    registered = registered or {}
    starts = []
    for vb in vbuckets:
        state = upstream[vb]
        position = registered.get(vb)
        if position is not None:
            starts.append(VbStart.from_resume(vb, position))
        elif flags & ConnectFlags.DUMP:
            # 2.x dumped ACTIVE vbuckets that hold items; an empty stream sends nothing.
            starts.append(VbStart.full(vb, end=state.high_seqno if state.active else 0))
        elif flags & ConnectFlags.CHECKPOINT and vb in checkpoints:
            ended = checkpoint_ends.get((vb, checkpoints[vb]))
            starts.append(VbStart.full(vb) if ended is None else VbStart.from_resume(vb, ended))
        elif flags & ConnectFlags.BACKFILL and (connect.backfill_date or 0) <= now:
            starts.append(VbStart.full(vb))
        else:
            high = state.high_seqno
            starts.append(VbStart(vb, high, uuid=state.uuid, snap_start=high, snap_end=high))
    return ConnectionPlan(name, flags, tuple(starts))
