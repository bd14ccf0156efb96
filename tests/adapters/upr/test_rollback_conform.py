"""The rollback rule as ep-engine 3.x decides it (src/failover-table.cc,
``FailoverTable::needsRollback`` of the 3.0.x line after 3.0.0, called from
src/upr-producer.cc ``streamRequest`` with the vbucket's high seqno and purge
seqno; 3.0.0's had neither the purge check nor the (start, start) snapshot).

Cases where 3.x differs from "roll back to min(snap_start, upper)": a
consumer at its snapshot's end has all of it; one at its snapshot's start
has nothing of it; the purge seqno is compared with the snapshot's start.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.upr.rollback import answer_stream_request, rollback_decision

LOG = ((30, 100), (20, 50), (10, 0))  # newest first: history 20 agrees up to 100
HIGH = 150


@pytest.mark.parametrize(
    ("start", "uuid", "snap", "purge", "expected"),
    [
        # At the end of its snapshot the consumer has all of it: (start, start).
        (120, 20, (90, 120), 0, 100),
        (100, 20, (90, 100), 0, None),
        # At the start of a snapshot reaching past ``upper``: nothing of it yet.
        (90, 20, (90, 120), 0, None),
        (100, 20, (100, 120), 0, None),
        # Part of a snapshot reaching past ``upper``: back to its start ...
        (95, 20, (80, 120), 0, 80),
        # ... or to ``upper`` when the snapshot starts at or past it.
        (115, 20, (110, 120), 0, 100),
        (160, 30, (155, 170), 0, 150),
        # Purged tombstones: the snapshot's start below the purge seqno.
        (60, 30, (40, 70), 45, 0),
        (70, 30, (40, 70), 45, None),  # at its end: (70, 70), nothing missed
        (45, 30, (45, 45), 45, None),
        (0, 99, (0, 0), 45, None),  # from 0 nothing is lost
        (10, 99, (10, 10), 0, 0),  # unknown history
    ],
)
def test_needs_rollback_cases(
    start: int, uuid: int, snap: tuple[int, int], purge: int, expected: int | None
) -> None:
    assert rollback_decision(LOG, HIGH, start, uuid, *snap, purge) == expected
    req = upr.StreamRequest(
        start_seqno=start,
        end_seqno=0xFFFFFFFFFFFFFFFF,
        vbucket_uuid=uuid,
        snap_start_seqno=snap[0],
        snap_end_seqno=snap[1],
        opaque=7,
    )
    answer = answer_stream_request(req, LOG, HIGH, purge_seqno=purge)
    if expected is None:
        assert answer == upr.StreamRequestOk(LOG, 7)
    else:
        assert answer == upr.StreamRequestRollback(expected, 7)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 200), min_size=1, max_size=5, unique=True),
    st.integers(0, 250),
    st.tuples(st.integers(0, 250), st.integers(0, 250), st.integers(0, 250)),
    st.integers(0, 6),
    st.integers(0, 250),
)
def test_rollback_keeps_what_history_shares(
    seqnos: list[int], high: int, points: tuple[int, int, int], pick: int, purge: int
) -> None:
    """Whatever the request, a rollback never goes past the start, and a
    consumer told to stream on has nothing beyond the shared history that
    it could keep: its snapshot ends by ``upper``, or it holds none of the
    part past ``upper`` (it is at the snapshot's start, or at its end below
    ``upper``)."""
    seqnos = sorted(seqnos, reverse=True)
    high = max(high, seqnos[0])
    entries = tuple((100 + i, s) for i, s in enumerate(seqnos))
    snap_start, start, snap_end = sorted(points)
    uuid = 100 + pick
    got = rollback_decision(entries, high, start, uuid, snap_start, snap_end, purge)
    uuids = [u for u, _ in entries]
    if start == 0:
        assert got is None
        return
    effective_start = start if start == snap_end else snap_start
    if effective_start < purge or uuid not in uuids:
        assert got == 0
        return
    index = uuids.index(uuid)
    upper = high if index == 0 else entries[index - 1][1]
    if got is None:
        assert snap_end <= upper or start == effective_start <= upper
    else:
        assert got <= start and got <= upper
