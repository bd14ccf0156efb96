"""The producer's answer to a STREAM_REQ: range checks and the 3.0 rollback rule.

Pure functions over a vbucket's failover log and seqnos, shared by every
producer that serves UPR (the reference node, the gateway's UPR front).

A failover log is a list of (uuid, seqno) pairs, newest first: "from this
seqno on, history is the one named by this uuid". A consumer presents
(uuid, start, snapshot range) and ``rollback_decision`` says whether, and
how far, it must roll back first. ``answer_stream_request`` adds the range
checks and the purge rule and returns the response event to send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from adapters.mcbp.constants import Status
from adapters.upr.constants import Command, StreamFlags
from adapters.upr.events import StreamRequest
from adapters.upr.responses import Response, StreamRequestOk, StreamRequestRollback


def rollback_decision(
    entries: Sequence[tuple[int, int]],
    high_seqno: int,
    start: int,
    uuid: int,
    snap_start: int,
    snap_end: int,
    purge_seqno: int = 0,
) -> int | None:
    """The seqno a consumer must roll back to, or ``None`` to stream from ``start``.

    ``entries`` is the producer's failover log, newest first. The 3.x rule
    (ep-engine src/failover-table.cc ``FailoverTable::needsRollback`` of the
    3.0.x line after 3.0.0; 3.0.0's had neither the purge check nor the
    (start, start) snapshot, so it rolled back further, to the snapshot's
    start, and missed purged tombstones): a
    consumer starting from 0 has nothing to lose. A consumer at the end of its
    snapshot has all of it, so its snapshot counts as (start, start). A
    snapshot beginning below ``purge_seqno`` may miss purged tombstones: back
    to 0. An unknown uuid means an unknown history: back to 0. Otherwise the
    consumer's history agrees with ours up to ``upper``, the seqno where the
    next newer history began (or our high seqno for the newest): a snapshot
    ending there is fine; one starting at or past it rolls back to ``upper``;
    one reaching past it rolls back to its start, unless the consumer has
    nothing of it yet (``start == snap_start``).
    """
    if start == 0:
        return None
    if start == snap_end:
        snap_start = start
    if snap_start < purge_seqno:
        return 0
    for index, (entry_uuid, _) in enumerate(entries):
        if entry_uuid == uuid:
            upper = high_seqno if index == 0 else entries[index - 1][1]
            break
    else:
        return 0
    if snap_end <= upper:
        return None
    if snap_start == start and upper == start:
        return None
    if snap_start >= upper:
        return upper
    if snap_start == start:
        return None
    return snap_start


_TO_WHAT_EXISTS = StreamFlags.LATEST | StreamFlags.DISK_ONLY


def resolve_end(req: StreamRequest, high_seqno: int) -> StreamRequest:
    """``req`` with the end seqno it asks for: LATEST (the high seqno at the
    request) and DISKONLY (the last persisted seqno; here what the producer
    holds) replace whatever end the consumer sent, before the range checks
    (ep-engine 3.0 src/upr-producer.cc ``streamRequest``)."""
    if req.flags & _TO_WHAT_EXISTS:
        return replace(req, end_seqno=high_seqno)
    return req


StreamAnswer = StreamRequestOk | StreamRequestRollback | Response


def refusal(req: StreamRequest, status: Status, text: str) -> Response:
    return Response(Command.STREAM_REQ, req.opaque, status.value, text.encode())


def range_refusal(
    req: StreamRequest, draft: bool = False, *, end_known: bool = True
) -> Response | None:
    """RANGE_ERROR for start > end or a start outside the snapshot, else None
    (3.0 upr-producer.cc ``streamRequest`` checks both before whether the
    vbucket streams already, and before the rollback rule). Without
    ``end_known`` (LATEST or DISKONLY not yet resolved) only the snapshot."""
    start, end = req.start_seqno, req.end_seqno
    if end_known and start > end:
        return refusal(req, Status.RANGE_ERROR, f"start seqno {start} > end seqno {end}")
    snap_start, snap_end = (start, start) if draft else (req.snap_start_seqno, req.snap_end_seqno)
    if not snap_start <= start <= snap_end:
        return refusal(
            req,
            Status.RANGE_ERROR,
            f"start seqno {start} outside snapshot {snap_start}..{snap_end}",
        )
    return None


def answer_stream_request(
    req: StreamRequest,
    entries: Sequence[tuple[int, int]],
    high_seqno: int,
    *,
    purge_seqno: int = 0,
    draft: bool = False,
    notifier: bool = False,
) -> StreamAnswer:
    """OK with the failover log, ROLLBACK, or RANGE_ERROR, for a known vbucket.

    The draft names no snapshot: its consumers resume at snapshot
    boundaries, so their snapshot is (start, start). A consumer whose
    snapshot starts below ``purge_seqno`` may have missed purged tombstones:
    it must start over from 0 (as 3.0 does).

    A notifier's request (OPEN flag 0x02) skips the range checks, and the
    rollback rule sees its start as at most the high seqno: a notifier waits
    for seqnos the producer does not have yet (ep-engine 3.0
    src/upr-producer.cc ``UprProducer::streamRequest``, ``notifyOnly``).
    """
    start = req.start_seqno
    if notifier:
        start = min(start, high_seqno)
    else:
        refused = range_refusal(req, draft)
        if refused is not None:
            return refused
    snap_start, snap_end = (start, start) if draft else (req.snap_start_seqno, req.snap_end_seqno)
    rollback = rollback_decision(
        entries, high_seqno, start, req.vbucket_uuid, snap_start, snap_end, purge_seqno
    )
    if rollback is not None:
        return StreamRequestRollback(rollback, req.opaque)
    return StreamRequestOk(tuple(entries), req.opaque)
