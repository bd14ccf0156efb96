"""Failover logs and the 3.0 rollback decision (PROTOCOL-NOTES, "Rollback decision")."""

from __future__ import annotations

import random

import pytest

from adapters.upr.failover_log import MAX_ENTRIES, FailoverLog, rollback_decision
from gateway.node.store import Store

# Newest first: history B began at seqno 100, history A at 0; we are at 150.
LOG = ((0xBBBB, 100), (0xAAAA, 0))
HIGH = 150


@pytest.mark.parametrize(
    ("start", "uuid", "snap_start", "snap_end", "expected"),
    [
        # start == 0: nothing to lose, never a rollback, even with an unknown uuid.
        (0, 0xDEAD, 0, 0, None),
        (0, 0xAAAA, 0, 500, None),
        # A uuid we never had: the consumer's history is unknown, back to 0.
        (10, 0xDEAD, 10, 10, 0),
        # Older history A is valid up to 100, where B began.
        (80, 0xAAAA, 50, 80, None),
        (100, 0xAAAA, 90, 100, None),
        (115, 0xAAAA, 90, 120, 90),  # snapshot reaches past 100: back to its start
        (115, 0xAAAA, 110, 120, 100),  # ... or to 100 if that is lower
        # Newest history: valid up to our high seqno.
        (150, 0xBBBB, 140, 150, None),
        (155, 0xBBBB, 140, 160, 140),
        (170, 0xBBBB, 160, 170, 150),
    ],
)
def test_rollback_decision_examples(
    start: int, uuid: int, snap_start: int, snap_end: int, expected: int | None
) -> None:
    assert rollback_decision(LOG, HIGH, start, uuid, snap_start, snap_end) == expected


def test_store_rollback_decision_uses_its_log_and_high_seqno() -> None:
    store = Store(1, rng=random.Random(4))
    first = store.uuid(0)
    for n in range(10):
        store.set(0, b"k%d" % n, b"", now=0.0)
    second = store.failover(0)
    for n in range(5):
        store.set(0, b"j%d" % n, b"", now=0.0)
    assert store.failover_log(0) == ((second, 10), (first, 0))
    # At the end of its snapshot (8..12) the consumer has all of it: back to 10,
    # where the histories part (src/failover-table.cc ``needsRollback``).
    assert store.rollback_decision(0, 12, first, 8, 12) == 10
    assert store.rollback_decision(0, 11, first, 8, 12) == 8
    assert store.rollback_decision(0, 10, first, 8, 10) is None
    assert store.rollback_decision(0, 15, second, 15, 15) is None
    assert store.rollback_decision(0, 16, second, 16, 16) == 15
    assert store.rollback_decision(0, 5, 12345, 5, 5) == 0


def test_log_is_bounded_newest_first_with_unique_48_bit_uuids() -> None:
    log = FailoverLog(random.Random(1))
    for seqno in range(40):
        log.add(seqno * 10)
    entries = log.entries
    assert len(entries) == MAX_ENTRIES
    assert [s for _, s in entries] == [s * 10 for s in range(39, 14, -1)]
    uuids = [u for u, _ in entries]
    assert len(set(uuids)) == len(uuids)
    assert all(0 < u < 1 << 48 for u in uuids)
    assert log.uuid == uuids[0]


def test_injected_rng_makes_uuids_deterministic() -> None:
    one = Store(8, rng=random.Random(99))
    two = Store(8, rng=random.Random(99))
    assert [one.uuid(vb) for vb in range(8)] == [two.uuid(vb) for vb in range(8)]


def test_add_prunes_entries_beyond_its_seqno() -> None:
    log = FailoverLog(random.Random(1), [(3, 50), (2, 20), (1, 0)])
    log.add(30)
    assert [s for _, s in log.entries] == [30, 20, 0]


def test_replace_keeps_at_most_25() -> None:
    log = FailoverLog(random.Random(1))
    log.replace((n, 100 - n) for n in range(1, 40))
    assert len(log) == MAX_ENTRIES and log.entries[0] == (1, 99)
