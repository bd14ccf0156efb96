"""A UPR takeover stream takes its vbucket over from the TAP node, and the gateway lets go.

What the engines do. ep-engine 3.0 (``src/upr-stream.cc``,
``ActiveStream::setVBucketStateAckRecieved``): a takeover stream that caught
up sends SET_VBUCKET_STATE(pending); on the consumer's reply the producer
makes its vbucket dead (``EventuallyPersistentStore::setVBucketState``, which
queues the state for the flusher to persist), sends what was queued before,
then SET_VBUCKET_STATE(active), and ends the stream OK on that reply. A
stream request for a vbucket the node does not hold gets NOT_MY_VBUCKET
(``src/upr-producer.cc``, ``UprProducer::streamRequest``), and a dead vbucket
stays dead across a restart (warmup loads the persisted state). A dead one is
still held, though: that ``streamRequest`` checks no state and streams it,
until ns_server deletes the old copy once the move is done
(``ns_vbucket_mover``: "Will delete it on", ``delete_vbucket_copies``); the
gateway answers NOT_MY_VBUCKET at once, as later servers do. ep-engine
2.5.1 (``src/tapconnection.cc``, ``TapProducer``) does the same over TAP: a
takeover connection sends VBUCKET_SET(pending), the stream, then makes its
vbucket dead before it queues VBUCKET_SET(active), and disconnects once the
last ack is in.

What the gateway does (``take_over``). It relays the TAP node's hand-off:
one TAP takeover connection for the vbucket (``Ingest(takeover=True)``,
publishing only synced records), whose VBUCKET_SET messages become the
stream's SET_VBUCKET_STATE, each TAP message acked only once the consumer
replied. Before SET_VBUCKET_STATE(active) goes out:

1. every record of the vbucket that was served is fsynced. With fsync
   "batch" the ingest publishes records before their fsync; the hand-off
   marks the log ``handing_over`` (from then on every committer publishes
   only synced records of it, as with fsync "always"), commits it itself
   and checks, with the log's lock held, that nothing served is unsynced.
   The mark stays until the consumer replied to the active state or the
   hand-off ended otherwise; no lock is held across that wait, so a
   consumer that never replies (ep-engine 3.0 puts no timer on it, only the
   connection's NOOP deadline ends it) stalls its own vbucket, not the
   ingest's commits and TAP acks of the others. A commit that fails, or
   records published meanwhile, are tried again a few times; then the hand-off fails with an
   error naming the vbucket, the stream ends STATE_CHANGED and the TAP
   message is never acked. So a crash after the hand-off never leaves the
   log behind what the new active node was sent. (Before, only the TAP
   ack waited for the fsync: a crash then cost no data, as the new active
   node holds it and the TAP node's copy is dead, but the restarted log
   ended below what that node had been sent, and was served again);
2. the vbucket is recorded as handed over: ``vb-NNNN/handed-over`` (one
   line saying when and to whom), created 0600, fsynced, renamed into
   place and its directory fsynced. A file of its own, written once: the
   meta and the manifest are rewritten all the time by the log, and a
   manifest rebuilt from the logs would forget it.

Streams of the vbucket on other connections stay open, as in 3.0, where
the hand-off makes the vbucket dead without telling its other streams
(``setVBucketState(vb, dead, false, false)``: ``notify_upr`` false, so
``UprConnMap::vbucketStateChanged`` is not called): they send what the log
holds, then nothing more comes (the TAP node's copy is dead too), until the
consumer closes them or the connection ends.

From then on the vbucket is dead here: stream requests get NOT_MY_VBUCKET,
``STAT vbucket`` says dead, the ingest leaves it out of its CONNECT, and its
log stays on disk untouched. After a restart the same holds, and start-up
logs one line naming the dead vbuckets. To serve one here again, stop the
gateway and delete its ``handed-over`` file: its log resumes where it was
handed over (a consumer that streamed it from the new active node rolls
back by the failover log as usual); to start it over from the TAP node
instead, move its ``vb-NNNN`` directory away (a missing directory is a
lost log: new history, fetched whole again).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from adapters import upr
from adapters.errors import GatewayError
from adapters.mcbp.constants import VBucketState
from gateway.fronts.upr.commit import commit
from gateway.fronts.upr.config import UprFrontError
from gateway.fronts.upr.ingest import Ingest
from gateway.fronts.upr.logset import vbucket_dirs
from gateway.fronts.upr.vblog import LogWriteError, VbLog
from gateway.metrics.figures import UPR_FRONT
from gateway.runtime.files import write_atomic

if TYPE_CHECKING:
    from gateway.fronts.upr.server import UprFront
    from gateway.fronts.upr.streams import LogStream

log = logging.getLogger(__name__)

HANDED_OVER = "handed-over"
"""The file in a vbucket's directory that says it was handed over (dead here)."""
SYNC_ATTEMPTS = 3
"""Commits tried before the hand-off gives up (a failed fsync, records published meanwhile)."""


class HandOverError(UprFrontError):
    """The vbucket could not be made durable or recorded as dead before the hand-off."""


# -- the record of a hand-off ------------------------------------------------------


def handed_over_path(vbdir: Path) -> Path:
    return vbdir / HANDED_OVER


def write_handed_over(vbdir: Path, text: str) -> None:
    """Record ``vbdir``'s vbucket as handed over: 0600, fsynced, renamed, directory fsynced.

    The temporary name ends ``.tmp``: one a crash leaves is removed by the next
    proof of the log, and without the rename the vbucket was never told active.
    """
    write_atomic(handed_over_path(vbdir), text.encode())


def read_handed_over(root: Path) -> dict[int, str]:
    """The vbuckets under ``root`` recorded as handed over, with what their file says."""
    out: dict[int, str] = {}
    for vb, vbdir in vbucket_dirs(root).items():
        path = handed_over_path(vbdir)
        try:
            out[vb] = path.read_text(errors="replace").strip()
        except FileNotFoundError:
            continue
    return out


def log_handed_over(root: Path, dead: dict[int, str]) -> None:
    """The one start-up line about the vbuckets handed over before."""
    if not dead:
        return
    names = ", ".join(str(vb) for vb in sorted(dead))
    log.warning(
        "vbuckets %s were handed over to UPR consumers (vb-NNNN/%s in %s): not ingested "
        "or served here (NOT_MY_VBUCKET); to serve one again, stop the gateway and "
        "delete its %s file",
        names,
        HANDED_OVER,
        root,
        HANDED_OVER,
    )


# -- the hand-off --------------------------------------------------------------------


async def take_over(front: UprFront, stream: LogStream) -> upr.StreamEndReason:
    """Take ``stream``'s vbucket over from the TAP node, through ``stream``."""
    vb = stream.vbucket
    front.stats.takeovers_started_total[UPR_FRONT] += 1
    handed: list[VBucketState] = []  # states the consumer has replied to

    async def on_state(vbucket: int, state: VBucketState) -> None:
        if vbucket != vb:
            return
        if state is VBucketState.ACTIVE:
            await _hand_over(front, stream)
        else:
            await stream.set_state(state)
        handed.append(state)

    ingest = Ingest(
        front.config,
        front.logs,
        front.stats,
        name=f"{front.config.tap_name}-takeover-{vb}",
        vbuckets=(vb,),
        takeover=True,
        state_hook=on_state,
    )
    try:
        async with front.capture_takeover(ingest):
            await ingest.session()
        if VBucketState.ACTIVE not in handed:
            raise UprFrontError("the TAP node closed the takeover before handing it over")
    except (OSError, trio.BrokenResourceError, GatewayError) as exc:
        if VBucketState.ACTIVE not in handed:
            log.warning("vbucket %d: takeover from the TAP node failed: %s", vb, exc)
            return upr.StreamEndReason.STATE_CHANGED
        # The node made its vbucket dead before it sent VBUCKET_SET(active)
        # and the consumer has taken it: the hand-off is done, however the
        # node then drops the connection (a reset when it closes with our
        # last ack or NOOP reply unread is ordinary TCP).
        log.info(
            "vbucket %d: TAP node ended the takeover connection after the hand-off: %s", vb, exc
        )
    front.taken_over.add(vb)
    await stream.catch_up()
    # Other connections' streams of the vbucket stay open: 3.0 makes it dead
    # with ``notify_upr`` false (src/upr-stream.cc ``setVBucketStateAckRecieved``
    # -> src/ep.cc ``setVBucketState``), so ``vbucketStateChanged`` ends none.
    front.stats.takeovers_completed_total[UPR_FRONT] += 1
    return upr.StreamEndReason.OK


async def _hand_over(front: UprFront, stream: LogStream) -> None:
    """SET_VBUCKET_STATE(active) through ``stream`` once every record of its vbucket that
    was served is synced and the vbucket is recorded as dead here; ``HandOverError``
    when either cannot be done (the consumer is then never told active).

    From the first commit until the consumer replied (or the hand-off failed, or
    was cancelled) the log is ``handing_over``: every committer publishes only
    synced records of it. No lock is held across the wait on the consumer, so a
    consumer that answers NOOPs and never this reply stalls its vbucket only,
    never the ingest's commits and TAP acks of the others.
    """
    vb = stream.vbucket
    vblog = stream.vblog
    vblog.handing_over = True  # before its own commit: nothing more published early
    try:
        await _sync_served(front, vb, vblog)
        await _record(front, stream, vblog)
        # ep-engine 3.0 puts no timer on this wait (``ActiveStream::takeoverWaitPhase``):
        # only the connection's NOOP deadline ends it, for a consumer gone silent.
        await stream.set_state(VBucketState.ACTIVE)
    finally:
        vblog.handing_over = False


async def _sync_served(front: UprFront, vb: int, vblog: VbLog) -> None:
    """Until every record of ``vblog`` that was served is synced (its lock held for the
    check: no committer between its write and its publish); ``HandOverError`` after
    ``SYNC_ATTEMPTS`` failed commits or records published meanwhile."""
    why = "records were published meanwhile"
    for _ in range(SYNC_ATTEMPTS):
        if front.logs.get(vb) is not vblog:
            raise HandOverError(f"vbucket {vb}: its log was set aside during the takeover")
        try:
            await commit({vb: vblog}, sync=front.config.fsync != "never")
        except LogWriteError as exc:
            why = str(exc)
            continue
        async with vblog.lock:
            if not (vblog.unsynced or vblog.sync_in_doubt):
                return
    raise HandOverError(
        f"vbucket {vb}: the records served could not be made durable before the "
        f"hand-off ({why}); the consumer is not told active"
    )


async def _record(front: UprFront, stream: LogStream, vblog: VbLog) -> None:
    vb = stream.vbucket
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = (
        f"vbucket {vb} handed over at {stamp} to UPR consumer {stream.conn.name} "
        f"at seqno {vblog.high_seqno}\n"
    )
    try:
        await trio.to_thread.run_sync(write_handed_over, vblog.dir, text)
    except OSError as exc:
        raise HandOverError(
            f"vbucket {vb}: cannot record the hand-off in {vblog.dir.name}/{HANDED_OVER}: "
            f"{exc.strerror or exc}; the consumer is not told active"
        ) from exc
    front.taken_over.add(vb)  # stream requests get NOT_MY_VBUCKET from here on
