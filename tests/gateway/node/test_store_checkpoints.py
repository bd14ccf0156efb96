"""Checkpoints: ids, item and time limits, history, lookup by seqno, rollback."""

from __future__ import annotations

import random

from gateway.node.checkpoints import Checkpoint, Checkpoints
from gateway.node.store import Store

NOW = 1_000.0


def ranges(store: Store, vb: int = 0) -> list[tuple[int, int, int, bool]]:
    return [(c.id, c.start_seqno, c.end_seqno, c.open) for c in store.checkpoints(vb)]


def test_new_checkpoint_every_k_items() -> None:
    store = Store(1, checkpoint_items=3, rng=random.Random(1))
    items = [store.set(0, b"k%d" % n, b"", now=NOW) for n in range(7)]
    assert [it.checkpoint_id for it in items] == [1, 1, 1, 2, 2, 2, 3]
    assert ranges(store) == [(1, 1, 3, False), (2, 4, 6, False), (3, 7, 7, True)]


def test_new_checkpoint_after_t_seconds_of_its_first_item() -> None:
    store = Store(1, checkpoint_seconds=5.0, rng=random.Random(1))
    assert store.maybe_close_checkpoints(NOW + 100) == 0  # empty: never closes on time
    store.set(0, b"a", b"", now=NOW)
    store.set(0, b"b", b"", now=NOW + 4.9)
    third = store.set(0, b"c", b"", now=NOW + 5.0)  # checked on the write itself
    assert third.checkpoint_id == 2
    assert store.maybe_close_checkpoints(NOW + 9.9) == 0
    assert store.maybe_close_checkpoints(NOW + 10.0) == 1
    assert ranges(store) == [(1, 1, 2, False), (2, 3, 3, False), (3, 4, 3, True)]


def test_checkpoint_of() -> None:
    store = Store(1, checkpoint_items=2, rng=random.Random(1))
    for n in range(5):
        store.set(0, b"k%d" % n, b"", now=NOW)
    assert store.checkpoint_of(0, 0) is None
    assert store.checkpoint_of(0, 1) == Checkpoint(1, 1, 2)
    assert store.checkpoint_of(0, 2) == Checkpoint(1, 1, 2)
    assert store.checkpoint_of(0, 4) == Checkpoint(2, 3, 4)
    assert store.checkpoint_of(0, 5) == Checkpoint(3, 5, 5, open=True)
    # The open checkpoint holds seqnos not written yet.
    assert store.checkpoint_of(0, 99) == Checkpoint(3, 5, 5, open=True)


def test_history_is_bounded() -> None:
    store = Store(1, checkpoint_items=1, checkpoint_history=10, rng=random.Random(1))
    for n in range(50):
        store.set(0, b"k", b"%d" % n, now=NOW)
    listing = store.checkpoints(0)
    assert len(listing) == 11
    assert [c.id for c in listing] == list(range(41, 52))
    assert store.checkpoint_of(0, 40) is None  # older than the history: a disk snapshot
    assert store.checkpoint_of(0, 41) == Checkpoint(41, 41, 41)


def test_close_checkpoint_follows_a_source_id() -> None:
    store = Store(1, rng=random.Random(1))
    store.set(0, b"a", b"", now=NOW)
    assert store.close_checkpoint(0, next_id=40) == 40
    assert store.close_checkpoint(0, next_id=5) == 41  # ids never go back
    assert store.set(0, b"b", b"", now=NOW).checkpoint_id == 41
    assert ranges(store) == [(1, 1, 1, False), (41, 2, 2, True)]


def test_becoming_active_closes_the_checkpoint() -> None:
    from gateway.node.store import VBucketState

    store = Store(1, initial_state=VBucketState.REPLICA, rng=random.Random(1))
    store.apply_mutation(0, b"a", b"", flags=0, expiration=0, cas=1, rev_seqno=1, now=NOW)
    store.set_state(0, VBucketState.ACTIVE, now=NOW)
    assert store.set(0, b"b", b"", now=NOW).checkpoint_id == 2


def test_rollback_cuts_checkpoints() -> None:
    store = Store(1, checkpoint_items=3, rng=random.Random(1))
    for n in range(8):
        store.set(0, b"k%d" % n, b"", now=NOW)
    store.rollback(0, 4)
    assert ranges(store) == [(1, 1, 3, False), (2, 4, 4, False), (4, 5, 4, True)]
    assert store.set(0, b"x", b"", now=NOW).checkpoint_id == 4


def test_rollback_inside_the_open_checkpoint() -> None:
    cps = Checkpoints(max_items=10)
    for seqno in range(1, 6):
        cps.wrote(seqno, NOW)
    cps.rollback(3)
    assert cps.listing() == [Checkpoint(1, 1, 3), Checkpoint(2, 4, 3, open=True)]
    cps.rollback(0)
    assert cps.listing() == [Checkpoint(3, 1, 0, open=True)]
