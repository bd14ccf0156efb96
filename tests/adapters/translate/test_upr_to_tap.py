"""UPR snapshots of one vbucket become TAP backfill and, for a client with the
CHECKPOINT flag, checkpoints (ep-engine 2.5.1 src/tapconnection.cc: checkpoint
messages are queued only when ``supportCheckpointSync_``, which
``TapProducer::evaluateFlags`` sets for that flag alone)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp.constants import VBucketState
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlags,
    TapMutation,
    TapOpaque,
    TapStreamMessage,
    TapVbucketSet,
)
from adapters.tap.constants import swap32
from adapters.translate.upr_to_tap import UprToTap
from adapters.upr import (
    Deletion,
    Expiration,
    Mutation,
    Noop,
    SetVbucketState,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    UprEvent,
)

DISK = SnapshotFlags.DISK
MEMORY = SnapshotFlags.MEMORY


def mutation(seqno: int, key: bytes = b"k", flags: int = 0) -> Mutation:
    return Mutation(
        key + b"%d" % seqno,
        b"value",
        by_seqno=seqno,
        rev_seqno=seqno,
        cas=seqno,
        flags=flags,
        nru=2,
        vbucket=3,
    )


def run(translator: UprToTap, events: list[UprEvent]) -> list[TapStreamMessage]:
    out: list[TapStreamMessage] = []
    for event in events:
        out.extend(translator.feed(event))
    return out


def names(messages: list[TapStreamMessage]) -> list[str]:
    labels = []
    for m in messages:
        if isinstance(m, TapOpaque):
            labels.append(OpaqueCode(m.opaque_code).name)
        elif isinstance(m, TapCheckpointStart | TapCheckpointEnd):
            labels.append(f"{m.NAME}:{m.checkpoint_id}")
        else:
            labels.append(m.NAME)
    return labels


def test_backfill_then_live_checkpoints() -> None:
    translator = UprToTap(3, backfill=True, checkpoint_sync=True)
    out = run(
        translator,
        [
            SnapshotMarker(0, 2, DISK),
            mutation(1),
            Deletion(b"gone", by_seqno=2, rev_seqno=4),
            SnapshotMarker(3, 4, MEMORY | SnapshotFlags.CHECKPOINT),
            mutation(3),
            mutation(4),
            SnapshotMarker(5, 5, MEMORY),
            Expiration(b"old", by_seqno=5, rev_seqno=2),
        ],
    )
    assert names(out) == [
        "INITIAL_VBUCKET_STREAM",
        "MUTATION",
        "DELETE",
        "CLOSE_BACKFILL",
        "CHECKPOINT_START:1",
        "MUTATION",
        "MUTATION",
        "CHECKPOINT_END:1",
        "CHECKPOINT_START:2",
        "DELETE",
        "CHECKPOINT_END:2",
    ]
    assert all(m.vbucket == 3 for m in out)
    assert translator.checkpoints == {1: (3, 4), 2: (5, 5)}
    assert translator.open is None
    assert out[2] == TapDelete(b"gone", vbucket=3, rev_seqno=4)


def test_short_snapshot_closes_at_the_next_marker_or_stream_end() -> None:
    translator = UprToTap(0, backfill=True, first_checkpoint_id=7, checkpoint_sync=True)
    out = run(
        translator,
        [
            SnapshotMarker(0, 10, DISK),
            mutation(4),  # tombstones purged: 10 never comes
            SnapshotMarker(11, 20, MEMORY),
            mutation(12),
            StreamEnd(),
        ],
    )
    assert names(out) == [
        "INITIAL_VBUCKET_STREAM",
        "MUTATION",
        "CLOSE_BACKFILL",
        "CHECKPOINT_START:7",
        "MUTATION",
        "CHECKPOINT_END:7",
    ]


def test_mutation_metadata_keys_only_and_flag_byte_order() -> None:
    host_order = UprToTap(3, backfill=False, keys_only=True, checkpoint_sync=True)
    (start, item) = run(host_order, [SnapshotMarker(1, 9, MEMORY), mutation(1, flags=0x01020304)])
    assert isinstance(start, TapCheckpointStart) and isinstance(item, TapMutation)
    assert item.value == b"" and item.tap_flags == TapFlags.NO_VALUE
    assert item.flags == 0x04030201 == swap32(0x01020304)
    assert (item.rev_seqno, item.cas, item.nru) == (1, 1, 2)
    network = UprToTap(3, backfill=False, network_byte_order=True, checkpoint_sync=True)
    (_, item) = run(network, [SnapshotMarker(1, 9, MEMORY), mutation(1, flags=0x01020304)])
    assert isinstance(item, TapMutation)
    assert item.flags == 0x01020304 and item.tap_flags == TapFlags.NETWORK_BYTE_ORDER
    assert item.value == b"value"


def test_state_change_and_protocol_errors() -> None:
    translator = UprToTap(5, backfill=False, checkpoint_sync=True)
    out = run(
        translator,
        [SnapshotMarker(1, 5, MEMORY), mutation(1), SetVbucketState(VBucketState.ACTIVE)],
    )
    assert names(out)[-2:] == ["CHECKPOINT_END:1", "VBUCKET_SET"]
    assert out[-1] == TapVbucketSet(VBucketState.ACTIVE, vbucket=5)
    with pytest.raises(ProtocolError, match="backwards"):
        translator.feed(mutation(1))
    with pytest.raises(ProtocolError, match="NOOP"):
        translator.feed(Noop())


@st.composite
def snapshot_streams(draw: st.DrawFn) -> list[UprEvent]:
    events: list[UprEvent] = []
    seqno = 0
    for index in range(draw(st.integers(1, 6))):
        size = draw(st.integers(0, 5))
        start, end = seqno + 1, seqno + max(size, 1)
        flags = DISK if index == 0 and draw(st.booleans()) else MEMORY
        events.append(SnapshotMarker(start, end, flags))
        for offset in range(size):
            seqno = start + offset
            events.append(
                mutation(seqno) if draw(st.booleans()) else Deletion(b"d%d" % seqno, by_seqno=seqno)
            )
        seqno = end
    return events


@given(snapshot_streams(), st.booleans(), st.booleans())
def test_every_item_once_in_order_inside_balanced_brackets(
    events: list[UprEvent], backfill: bool, checkpoint_sync: bool
) -> None:
    """Items outside a backfill are bracketed by checkpoints with checkpoint sync, and
    come alone without it (tapconnection.cc ``supportCheckpointSync_``)."""
    translator = UprToTap(1, backfill=backfill, checkpoint_sync=checkpoint_sync)
    out = run(translator, events) + translator.finish()
    items = [m for m in out if isinstance(m, TapMutation | TapDelete)]
    sent = [e for e in events if isinstance(e, Mutation | Deletion)]
    assert [m.key for m in items] == [e.key for e in sent]
    open_bracket: str | None = None
    ids = []
    for message in out:
        if isinstance(message, TapCheckpointStart):
            assert open_bracket is None
            open_bracket = f"cp{message.checkpoint_id}"
            ids.append(message.checkpoint_id)
        elif isinstance(message, TapCheckpointEnd):
            assert open_bracket == f"cp{message.checkpoint_id}"
            open_bracket = None
        elif isinstance(message, TapOpaque):
            if message.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM:
                assert open_bracket is None and out.index(message) == 0
                open_bracket = "backfill"
            else:
                assert open_bracket == "backfill"
                open_bracket = None
        else:
            assert open_bracket is not None or not checkpoint_sync
    assert open_bracket is None
    assert ids == sorted(set(ids))
    if not checkpoint_sync:
        assert not ids and not translator.checkpoints


def test_checkpoint_records_what_was_sent_and_ids_come_from_a_shared_counter() -> None:
    import itertools

    ids = itertools.count(40)
    first, second = (
        UprToTap(1, backfill=False, checkpoint_ids=ids, checkpoint_sync=True),
        UprToTap(2, backfill=False, checkpoint_ids=ids, checkpoint_sync=True),
    )
    run(first, [SnapshotMarker(3, 9, MEMORY), mutation(4), mutation(6), StreamEnd()])
    out = run(second, [SnapshotMarker(1, 1, MEMORY), mutation(1)])
    assert first.checkpoints == {40: (4, 6)}
    assert names(out) == ["CHECKPOINT_START:41", "MUTATION", "CHECKPOINT_END:41"]


def test_resume_continues_the_open_checkpoint_and_the_open_backfill() -> None:
    translator = UprToTap(0, backfill=True, checkpoint_sync=True)
    out = run(translator, [SnapshotMarker(0, 10, DISK), mutation(3)])
    translator.resume()
    out += run(translator, [SnapshotMarker(4, 12, DISK), mutation(11), mutation(12)])
    out += run(translator, [SnapshotMarker(13, 15, MEMORY), mutation(13)])
    translator.resume()
    out += run(translator, [SnapshotMarker(14, 15, MEMORY), mutation(15)])
    assert names(out) == [
        "INITIAL_VBUCKET_STREAM",
        "MUTATION",
        "MUTATION",
        "MUTATION",
        "CLOSE_BACKFILL",
        "CHECKPOINT_START:1",
        "MUTATION",
        "MUTATION",
        "CHECKPOINT_END:1",
    ]
    assert translator.checkpoints == {1: (13, 15)}


def test_an_unfinished_backfill_goes_on_without_a_reset() -> None:
    translator = UprToTap(0, backfill=True, continue_backfill=True)
    out = run(translator, [SnapshotMarker(5, 7, DISK), mutation(6), mutation(7)])
    assert names(out) == ["MUTATION", "MUTATION", "CLOSE_BACKFILL"]
    assert translator.last_closed_checkpoint == 0


def test_without_checkpoint_sync_live_items_come_alone() -> None:
    """No CHECKPOINT flag: the backfill keeps its OPAQUE brackets (2.5.1
    tapconnection.cc sends INITIAL_VBUCKET_STREAM and CLOSE_BACKFILL whatever the
    flags), live snapshots send no CHECKPOINT_START/END, draw no id from the shared
    counter and leave no checkpoint to resume from; a resumed stream still
    continues the snapshot that was open."""
    import itertools

    ids = itertools.count(40)
    translator = UprToTap(3, backfill=True, checkpoint_ids=ids)
    out = run(
        translator,
        [
            SnapshotMarker(0, 2, DISK),
            mutation(1),
            mutation(2),
            SnapshotMarker(3, 4, MEMORY | SnapshotFlags.CHECKPOINT),
            mutation(3),
        ],
    )
    translator.resume()
    out += run(translator, [SnapshotMarker(4, 4, MEMORY), mutation(4)])
    out += run(translator, [SnapshotMarker(5, 9, MEMORY), mutation(5), StreamEnd()])
    assert names(out) == [
        "INITIAL_VBUCKET_STREAM",
        "MUTATION",
        "MUTATION",
        "CLOSE_BACKFILL",
        "MUTATION",
        "MUTATION",
        "MUTATION",
    ]
    assert translator.checkpoints == {} and translator.last_closed_checkpoint == 0
    assert next(ids) == 40
    assert translator.open is None and translator.last_seqno == 5
