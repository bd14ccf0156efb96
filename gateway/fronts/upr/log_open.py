"""Opening a vbucket's log: prove it and continue its history, or set it aside and start over.

Opening (``proof.prove_vbucket``) proves the log or refutes it.

- Proven: records are replayed into a fresh ``TapToUpr`` (index and phase)
  and a torn tail is cut. The history continues after a clean close. After
  any other end (a crash, a kill) what consumers saw may not all be there
  (records are served before their fsync): as ep-engine 3.0's warmup after
  an unclean shutdown (``src/warmup.cc``), a new failover entry starts at
  the proven end, so a consumer that saw more rolls back to it by 3.0's
  rule (its snapshot ends above its entry's upper bound), and the next
  seqno jumps past the reserved seqno, so no seqno is used twice.
- Refuted (a segment or the directory missing, a damaged record before
  the tail, a damaged or missing meta): the vbucket directory is renamed
  into ``state_dir/set-aside/`` untouched (with ``why.txt``), and the
  vbucket starts over empty: a failover log of one entry, a uuid it never
  had, starting above every seqno it may have handed out, and a re-fetch
  from the TAP node pending (``needs_refetch``: the ingest deregisters its
  TAP name so the node backfills the vbucket). Consumers presenting an old
  uuid roll back to 0 (3.0's rule for an unknown uuid) and receive the
  node's data again; one warning names the files and what was wrong.

Seqnos above anything handed out. Before ``publish`` exposes a seqno above
``reserved``, ``reserved`` moves ``RESERVE_STEP`` past it in the meta and
in the state directory's manifest (``manifest``), both fsynced. So after
losing segments the meta still bounds what was published; after losing
the meta (or the whole directory) the manifest does; with both gone, the
highest seqno readable in the surviving or set-aside segments and the
metas of logs set aside before give a lower bound only. The new history
therefore never relies on seqnos alone: its uuid is drawn from the
operating system's random source (whatever the test seed), excluding every
uuid these sources name, so no (uuid, seqno) pair can name two versions,
and every consumer of an old history rolls back to 0.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from adapters.translate.tap_to_upr import TapToUpr
from adapters.upr.failover_log import UUID_BITS
from gateway.fronts.upr.proof import VbProof, set_aside, set_aside_bound
from gateway.runtime.files import fsync_dir

if TYPE_CHECKING:
    from gateway.fronts.upr.vblog import VbLog

log = logging.getLogger("gateway.fronts.upr.vblog")  # under the log's name, with its other warnings

_uuids = random.SystemRandom()


def fresh_uuid(taken: Iterable[int]) -> int:
    """A vbucket uuid from the OS random source, never 0 and none of ``taken``."""
    avoid = set(taken)
    while True:
        uuid = _uuids.getrandbits(UUID_BITS)
        if uuid and uuid not in avoid:
            return uuid


def adopt(vblog: VbLog, proof: VbProof) -> None:
    """Open the proven log of ``proof``: cut its torn tail, continue or reconcile its history."""
    vblog.dir.mkdir(parents=True, exist_ok=True)
    for path in proof.leftovers + proof.strays:
        # Covered by a finished compaction, or half-written temporaries.
        path.unlink(missing_ok=True)
    for path, good, _size in proof.torn:
        with open(path, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    vblog.torn_bytes = proof.torn_bytes
    vblog.segments = proof.segments
    vblog.disk_high = proof.high_seen
    meta = proof.meta
    if meta is None:
        vblog.history.begin()  # a new vbucket
        return
    vblog.history.restore(meta.failover, meta.reserved, meta.purge_seqno, meta.refetch)
    vblog.disk_high = max(proof.high_seen, meta.failover[0][1])  # as the proof's end
    # A history that began above its last item (started over, nothing fetched yet)
    # goes on from its start, never from the records' end: seqnos below it were served.
    t = vblog.translator
    t.high_seqno = max(t.high_seqno, meta.failover[0][1])
    if not proof.torn and meta.clean:
        return
    # Not closed cleanly: consumers may have been served records that never
    # reached the disk (fsync batch and never publish before their fsync): a new
    # failover entry at the proven end, new seqnos past every one reserved.
    uuid, proven, t.high_seqno = vblog.history.reconcile_unclean(t.high_seqno)
    vblog.disk_high = max(vblog.disk_high, proven)
    if proof.torn:
        path, good, size = proof.torn[0]
        why = (
            f"torn tail of {size - good} bytes cut from {path.parent.name}/{path.name} "
            "(an append a crash interrupted before its fsync)"
        )
    else:
        why = "not closed cleanly: records served before their fsync may be lost"
    log.warning(
        "vbucket %d: %s: new history %d at seqno %d, new items from seqno %d",
        vblog.vbucket,
        why,
        uuid,
        proven,
        t.high_seqno + 1,
    )


def start_over(vblog: VbLog, proof: VbProof, known_bound: int, known_uuids: set[int]) -> None:
    """Set the unproven log of ``proof`` aside and start the vbucket over (see the module)."""
    bound, uuids = proof.bound()
    earlier, earlier_uuids = set_aside_bound(vblog.root, vblog.vbucket)
    bound = max(bound, known_bound, earlier)
    uuids |= known_uuids | earlier_uuids
    if proof.exists:
        vblog.set_aside = set_aside(vblog.root, vblog.dir, [p.text for p in proof.problems])
    vblog.dir.mkdir(parents=True)
    fsync_dir(vblog.root)
    vblog.translator = TapToUpr(
        vblog.vbucket, high_seqno=bound, expiry_tolerance=vblog.expiry_tolerance
    )
    uuid = fresh_uuid(uuids)
    vblog.history.start_over(bound, uuid)
    vblog.disk_high = bound  # the new history's start
    vblog.segments = []
    kept = (
        f"files kept in {vblog.set_aside.relative_to(vblog.root)}"
        if vblog.set_aside is not None
        else "no files left to keep"
    )
    log.warning(
        "vbucket %d: log not proven: %s; %s; new history %d from seqno %d "
        "(consumers roll back to 0); re-fetching the vbucket from the TAP node",
        vblog.vbucket,
        "; ".join(p.text for p in proof.problems),
        kept,
        uuid,
        bound,
    )
