"""Where a TAP stream starts in each vbucket: CONNECT flags against the store."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp import Status
from adapters.tap import ConnectFlags, TapConnect
from gateway.fronts.tap.plan import UpstreamVbucket, plan_connection
from gateway.node.items import VBucketState
from gateway.node.store import Store
from gateway.node.tap_plan import Phase, plan_stream, resume_after_checkpoint
from gateway.node.tap_registry import Registration, VbPosition
from tests.support.tap_client import FUTURE

F = ConnectFlags

ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 15)),
        st.tuples(st.just("delete"), st.integers(0, 15)),
        st.tuples(st.just("close"), st.integers(0, 3)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, history=st.integers(1, 6), per_checkpoint=st.integers(1, 7), data=st.data())
def test_resume_after_checkpoint_never_skips_or_repeats(
    ops: list[tuple[str, int]], history: int, per_checkpoint: int, data: st.DataObject
) -> None:
    """Resuming after checkpoint C sends exactly the items written after C."""
    store = Store(1, checkpoint_items=per_checkpoint, checkpoint_history=history)
    now = time.time()
    for op, arg in ops:
        if op == "set":
            store.set(0, b"k%d" % arg, b"v", now=now)
        elif op == "delete" and store.lookup(0, b"k%d" % arg) is not None:
            if not store.lookup(0, b"k%d" % arg).deleted:  # type: ignore[union-attr]
                store.delete(0, b"k%d" % arg, now=now)
        elif op == "close":
            current = store.checkpoints(0)[-1].id
            store.close_checkpoint(0, next_id=current + arg)
    listing = store.checkpoints(0)
    client = data.draw(st.integers(0, listing[-1].id + 2))
    after = resume_after_checkpoint(store, 0, client)
    closed_ids = {cp.id for cp in listing if not cp.open}
    if client in closed_ids:
        assert after is not None  # a checkpoint still kept can always be resumed
    if client >= listing[-1].id:
        assert after is None
    if after is not None:
        for item in store.items_since(0, 0):
            assert (item.by_seqno > after) == (item.checkpoint_id > client)


def connect(flags: ConnectFlags, **kwargs: object) -> TapConnect:
    return TapConnect(b"c", flags, **kwargs)  # type: ignore[arg-type]


def test_precedence_of_the_connect_flags() -> None:
    store = Store(4, checkpoint_items=2)
    now = time.time()
    for i in range(10):
        store.set(i % 4, b"k%d" % i, b"v", now=now)
    store.set_state(3, VBucketState.REPLICA, now=now)
    # Every ACTIVE vbucket; backfill in the past: everything, reset first.
    plan = plan_stream(connect(F.BACKFILL, backfill_date=5), "c", store, None, now)
    assert [(c.vb, c.phase, c.reset, c.seqno) for c in plan.cursors] == [
        (vb, Phase.BACKFILL, True, 0) for vb in (0, 1, 2)
    ]
    # Backfill in the future: only new changes.
    plan = plan_stream(connect(F.BACKFILL, backfill_date=FUTURE), "c", store, None, now)
    assert [(c.phase, c.seqno) for c in plan.cursors] == [
        (Phase.LIVE, store.high_seqno(vb)) for vb in (0, 1, 2)
    ]
    # A dump is a backfill that resets the receiver (2.x tapconnection.cc, registerCursor).
    plan = plan_stream(connect(F.DUMP | F.LIST_VBUCKETS, vbuckets=(3, 3)), "c", store, None, now)
    assert [(c.vb, c.phase, c.reset) for c in plan.cursors] == [(3, Phase.BACKFILL, True)]
    # A list of none is every ACTIVE vbucket, and unknown flag bits change nothing
    # (2.x ep_engine.cc, createTapQueue; vbucket.hh, VBucketFilter).
    for flags in (F.BACKFILL | F.LIST_VBUCKETS, F.BACKFILL | ConnectFlags(0x8000_0200)):
        plan = plan_stream(connect(flags, backfill_date=5), "c", store, None, now)
        assert [(c.vb, c.phase, c.reset) for c in plan.cursors] == [
            (vb, Phase.BACKFILL, True) for vb in (0, 1, 2)
        ]
    # Checkpoints beat backfill; a registered position beats both.
    registration = Registration("c", {1: VbPosition(1, 1)})
    flags = F.BACKFILL | F.CHECKPOINT | F.LIST_VBUCKETS | F.REGISTERED_CLIENT
    request = connect(flags, backfill_date=0, vbuckets=(0, 1, 2), checkpoints=((0, 1), (2, 99)))
    plan = plan_stream(request, "c", store, registration, now)
    assert [(c.phase, c.seqno, c.reset) for c in plan.cursors] == [
        (Phase.LIVE, store.checkpoints(0)[0].end_seqno, False),
        (Phase.LIVE, 1, False),
        (Phase.BACKFILL, 0, True),  # checkpoint 99 was never closed here
    ]


def test_registered_position_in_a_backfill_continues_it() -> None:
    store = Store(1)
    now = time.time()
    for i in range(5):
        store.set(0, b"k%d" % i, b"v", now=now)
    registration = Registration("r", {0: VbPosition(3, 0, backfill_done=False)})
    plan = plan_stream(connect(F.REGISTERED_CLIENT), "r", store, registration, now)
    cursor = plan.cursors[0]
    assert (cursor.phase, cursor.seqno, cursor.reset) == (Phase.BACKFILL, 3, False)
    # A position past the vbucket's end (it was reset) starts over.
    registration.positions[0] = VbPosition(50, 9)
    cursor = plan_stream(connect(F.REGISTERED_CLIENT), "r", store, registration, now).cursors[0]
    assert (cursor.phase, cursor.seqno, cursor.reset) == (Phase.BACKFILL, 0, True)


@pytest.mark.parametrize(
    "request_",
    [
        connect(F.TAKEOVER_VBUCKETS),
        connect(F.TAKEOVER_VBUCKETS | F.LIST_VBUCKETS),
    ],
)
def test_connects_the_node_cannot_serve(request_: TapConnect) -> None:
    with pytest.raises(ProtocolError) as info:
        plan_stream(request_, "c", Store(4), None, time.time())
    assert info.value.status == Status.NOT_SUPPORTED


def test_a_vbucket_the_store_lacks_is_skipped() -> None:
    """ep-engine 2.x src/tapconnection.cc ``TapProducer::registerCursor`` skips it."""
    request_ = connect(F.LIST_VBUCKETS | F.CHECKPOINT, vbuckets=(4, 1), checkpoints=((9, 1),))
    plan = plan_stream(request_, "c", Store(4), None, time.time())
    assert [cursor.vb for cursor in plan.cursors] == [1]


NOW = 1_000_000.0
PLAN_FLAGS = [ConnectFlags.DUMP, ConnectFlags.CHECKPOINT, ConnectFlags.BACKFILL]
DATES = st.sampled_from([None, 0, int(NOW), int(NOW) + 1, (1 << 64) - 1])


@given(st.lists(st.sampled_from(PLAN_FLAGS), unique=True), DATES)
def test_the_node_and_the_front_start_a_vbucket_alike(
    chosen: list[ConnectFlags], date: int | None
) -> None:
    """Without a registration or checkpoint map both producers decide the same
    (``adapters.tap.plan``): a full backfill or live from the high seqno."""
    flags = ConnectFlags(0)
    for flag in chosen:
        flags |= flag
    connect = TapConnect(b"c", flags, backfill_date=date)
    node = plan_stream(connect, "c", Store(4), None, NOW)
    upstream = {vb: UpstreamVbucket(vb, True, 1, 0) for vb in range(4)}
    front = plan_connection(connect, "c", upstream, registered=None, checkpoint_ends={}, now=NOW)
    assert [c.vb for c in node.cursors] == [s.vbucket for s in front.starts]
    assert [c.phase is Phase.BACKFILL for c in node.cursors] == [s.backfill for s in front.starts]
