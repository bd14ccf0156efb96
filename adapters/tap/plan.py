"""Where each vbucket of a TAP CONNECT starts: the 2.x precedence, once.

Theory of operation. Every TAP producer here (the reference node, the TAP
front) reads a CONNECT once, at connect time, and asks two questions of it
through this module; each then turns the answers into its own cursors (the
node's over its store, the front's as UPR stream requests).

``connect_vbuckets``: which vbuckets the stream serves, the listed ones (in
order, once each; a list of none means all, see ``adapters.tap.connect``) or
every vbucket ACTIVE at connect time. A listed vbucket the producer does
not have is skipped, and a checkpoint-map entry for one is ignored, as 2.x
did (tapconnmap.cc ``newProducer`` checks nothing; tapconnection.cc
``registerCursor`` logs "VBucket %d not found for TAP cursor. Skip it..."
and goes on): the connection streams the others (``skipped_vbuckets`` names
the skipped ones). TAKEOVER_VBUCKETS with DUMP refuses the CONNECT (a
takeover hands the vbucket over; a dump ends): ``ProtocolError`` with
status NOT_SUPPORTED, naming the field.

``start_of``: how one vbucket starts, in the order of precedence ep-engine
2.x used (ep_engine.cc ``createTapQueue``):

1. ``RESUME``: a registered client that holds a position in the vbucket
   resumes there (an unfinished backfill continues);
2. ``DUMP``: a backfill of everything, wrapped like any backfill, then the
   stream ends;
3. ``CHECKPOINT``: CHECKPOINT with an entry for the vbucket: after the last
   closed checkpoint the client names;
4. ``BACKFILL``: BACKFILL with a date now or in the past (0 included):
   everything; a date in the future (all ones, say) is only new changes;
5. ``LIVE``: only new changes, from the high seqno at connect.

Where a resume point (1, 3) is no longer known the producer falls back to a
full backfill that starts with OPAQUE(INITIAL_VBUCKET_STREAM), so the
receiver resets the vbucket first; that test is the producer's (it alone
knows its history).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from enum import Enum

from adapters.tap import ConnectFlags, TapConnect
from adapters.tap.connect import connect_refusal, listed_vbuckets


class Start(Enum):
    RESUME = "resume"
    DUMP = "dump"
    CHECKPOINT = "checkpoint"
    BACKFILL = "backfill"
    LIVE = "live"


def connect_vbuckets(
    connect: TapConnect, known: Container[int], active: Iterable[int]
) -> tuple[int, ...]:
    """The vbuckets ``connect`` streams (see the module docstring); ``known`` are
    the producer's vbuckets, ``active`` its ACTIVE ones in order."""
    flags = connect.connect_flags
    if flags & ConnectFlags.TAKEOVER_VBUCKETS and flags & ConnectFlags.DUMP:
        raise connect_refusal(
            "TAKEOVER_VBUCKETS and DUMP exclude each other", field="flags", value=int(flags)
        )
    if listed_vbuckets(connect):
        return tuple(vb for vb in dict.fromkeys(connect.vbuckets) if vb in known)
    return tuple(active)


def skipped_vbuckets(connect: TapConnect, known: Container[int]) -> tuple[int, ...]:
    """The listed vbuckets the producer does not have, in order, once each."""
    if not listed_vbuckets(connect):
        return ()
    return tuple(vb for vb in dict.fromkeys(connect.vbuckets) if vb not in known)


def start_of(
    connect: TapConnect,
    vb: int,
    *,
    registered: Container[int],
    checkpoints: Mapping[int, int],
    now: float,
) -> Start:
    """How ``vb`` starts (see the module docstring): ``registered`` are the vbuckets
    the client holds a position in, ``checkpoints`` the CONNECT's checkpoint map."""
    flags = connect.connect_flags
    if vb in registered:
        return Start.RESUME
    if flags & ConnectFlags.DUMP:
        return Start.DUMP
    if flags & ConnectFlags.CHECKPOINT and vb in checkpoints:
        return Start.CHECKPOINT
    if flags & ConnectFlags.BACKFILL and (connect.backfill_date or 0) <= now:
        return Start.BACKFILL
    return Start.LIVE
