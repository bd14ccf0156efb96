"""A log found damaged while serving: set aside, started over, fetched again.

A stream that reads a published record the disk no longer gives back whole
gets ``LogReadError`` (``segments``). The log cannot be proven any more, so
it goes the way start-up sends a log it cannot prove (``log_open.start_over``,
``LogSet.start_over``): its directory is set aside untouched with
``why.txt``, the vbucket starts over with a uuid it never had, and the
ingest reconnects to fetch it whole again from the TAP node. Every stream of
the vbucket ends with STREAM_END "state changed", as ep-engine 3.0 ends the
streams of a vbucket whose state changes under them (``src/upr-stream.cc``,
``END_STREAM_STATE``); a consumer asking again with its old uuid is told to
roll back to 0 (``adapters.upr.rollback``: an unknown uuid) and gets the
re-fetched data. One warning line and ``log_damage_total`` per vbucket.

The rename and its fsyncs run in a worker thread (``LogSet.start_over_async``)
with the log's lock held, so no commit writes or publishes it meanwhile; the
damaged log is retired first (its writes raise), and the ingest's connection
writes only the logs it opened with (``Ingest.restart``): what it had read
before it is told to reconnect cannot reach the log that replaced this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from adapters import upr
from gateway.fronts.upr.proof import Problem
from gateway.fronts.upr.segments import LogReadError
from gateway.fronts.upr.vblog import VbLog

if TYPE_CHECKING:
    from gateway.fronts.upr.server import UprFront


async def set_aside_damaged(front: UprFront, vblog: VbLog, exc: LogReadError) -> None:
    """Replace ``vblog`` (damaged, as ``exc`` says) by a log that starts over, once.

    Shielded: a stream ended meanwhile must not leave the damaged log served.
    """
    with trio.CancelScope(shield=True):
        async with front.log_swaps:  # no compaction of it running
            await _when_idle(front, vblog, exc)


async def _when_idle(front: UprFront, vblog: VbLog, exc: LogReadError) -> None:
    while front.logs.logs.get(vblog.vbucket) is vblog:
        # Nobody between a write and its publish, no fsync of it in flight (its
        # failure would cut back the file), no segment swap.
        await vblog.segments_settled()
        async with vblog.lock:
            if vblog.swapping:
                continue
            if not vblog.syncing:
                if front.logs.logs.get(vblog.vbucket) is vblog:
                    await _start_over(front, vblog, exc)  # the lock held throughout
                return
            returned = vblog.sync_returned
        await returned.wait()


async def _start_over(front: UprFront, vblog: VbLog, exc: LogReadError) -> None:
    """With nothing writing ``vblog`` (its lock held): the rename and fsyncs in a worker
    thread, then the ingest and the streams told at once, with no checkpoint between."""
    vb = vblog.vbucket
    # The one warning line is ``log_open.start_over``'s (vbucket, file, offset, why).
    problem = Problem("segment_damaged", f"found while serving: {exc}")
    await front.logs.start_over_async(vblog, problem)
    front.stats.upr_log.log_damage_total[vb] += 1
    front.ingest.restart(f"vbucket {vb} is fetched again")
    for connection in front.connections.values():
        stream = connection.streams.get(vb)
        if stream is not None and stream.live and stream.vblog is vblog:
            stream.close(upr.StreamEndReason.STATE_CHANGED)
