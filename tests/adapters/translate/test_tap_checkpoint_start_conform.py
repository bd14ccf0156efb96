"""The TAP front's CHECKPOINT_START carries no engine-specific bytes.

A 2.5.1 producer sends the vbucket's max deleted rev seqno there, 8 bytes
(ep-engine ``src/ep_engine.cc`` ``walkTapQueue``: ``TapEngineSpecific::
packSpecificData(TAP_CHECKPOINT_START, ..., vb->ht.getMaxDeletedRevSeqno())``;
the reference node does the same). UPR carries no such value. The consumer
(``EventuallyPersistentEngine::tapNotify``, case TAP_CHECKPOINT_START, read
in a 3.0-era copy with the 2.5 branch unchanged) stores it only when
``nengine == TapEngineSpecific::sizeRevSeqno`` and then *overwrites* its own
(``ht.setMaxDeletedRevSeqno``, a store, not ``updateMaxDeletedRevSeqno``'s
set-if-bigger); without it nothing changes. The consumer raises its value
itself for every deletion it applies (``HashTable::unlocked_softDelete``
calls ``updateMaxDeletedRevSeqno``). The only stand-in the front has, the
largest rev seqno of the deletions it forwarded, is therefore never above
what the consumer already holds, and sent would lower a value the consumer
knew from its own warm-up or an earlier connection: a key re-created there
would then get a rev seqno at or below an older deletion's, and lose to it
in XDCR conflict resolution. So the front sends none, on both paths.

Checkpoint messages go only to a client with the CHECKPOINT flag (2.5.1
src/tapconnection.cc ``supportCheckpointSync_``): the translators here have it.
"""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from adapters import upr
from adapters.tap import TapCheckpointStart, TapOpcode, encode
from adapters.tap.producer import TapProducer
from adapters.translate.upr_to_tap import UprToTap
from adapters.translate.upr_to_tap_fast import marker_frame, translate_items
from adapters.upr import SnapshotFlags

VB = 9
OPAQUE = 7
ENGINE_SPECIFIC_LENGTH = struct.Struct(">H")  # the first bytes of the TAP extras
EXTRAS_AT = 24

memory_flags = st.sampled_from(
    [SnapshotFlags.MEMORY, SnapshotFlags.MEMORY | SnapshotFlags.CHECKPOINT]
)


def removed_then_marker(rev_seqno: int, flags: SnapshotFlags) -> list[upr.UprEvent]:
    """A deletion with a large rev seqno (what a stand-in would come from), then a
    new checkpoint."""
    return [
        upr.SnapshotMarker(1, 1, SnapshotFlags.MEMORY, vbucket=VB, opaque=OPAQUE),
        upr.Deletion(b"gone", by_seqno=1, rev_seqno=rev_seqno, vbucket=VB, opaque=OPAQUE),
        upr.SnapshotMarker(2, 5, flags, vbucket=VB, opaque=OPAQUE),
    ]


def engine_specific_length(frame: bytes) -> int:
    assert frame[1] == TapOpcode.CHECKPOINT_START
    (length,) = ENGINE_SPECIFIC_LENGTH.unpack_from(frame, EXTRAS_AT)
    return length


@given(st.integers(1, 2**63), memory_flags)
def test_event_path_checkpoint_start_has_no_engine_specific(
    rev_seqno: int, flags: SnapshotFlags
) -> None:
    translator = UprToTap(VB, backfill=False, checkpoint_sync=True)
    out = [m for event in removed_then_marker(rev_seqno, flags) for m in translator.feed(event)]
    starts = [m for m in out if isinstance(m, TapCheckpointStart)]
    assert starts and all(m.engine_specific == b"" for m in starts)
    assert all(engine_specific_length(encode(m)) == 0 for m in starts)


@given(st.integers(1, 2**63), memory_flags)
def test_fast_paths_checkpoint_start_has_no_engine_specific(
    rev_seqno: int, flags: SnapshotFlags
) -> None:
    producer = TapProducer(support_ack=False)
    translator = UprToTap(VB, backfill=False, checkpoint_sync=True)
    data = marker_frame(translator, producer, 1, 1, SnapshotFlags.MEMORY)
    assert data is not None and engine_specific_length(data) == 0

    # the run of a live stream: the deletion closes its checkpoint, the marker opens one
    translator = UprToTap(VB, backfill=False, checkpoint_sync=True)
    first, deletion, marker = removed_then_marker(rev_seqno, flags)
    translator.feed(first)
    wire = upr.encode(deletion) + upr.encode(marker)
    out: list[bytes] = []
    translate_items(wire, 0, {OPAQUE: translator}, producer, out, {}, [])
    starts = [frame for frame in out if frame[1] == TapOpcode.CHECKPOINT_START]
    assert starts and all(engine_specific_length(frame) == 0 for frame in starts)
