"""STREAM_REQ answers: range checks, the 3.0 rollback rule, purged tombstones."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import Status
from adapters.upr.rollback import answer_stream_request, rollback_decision

LOG = ((30, 100), (20, 50), (10, 0))  # newest first
MAX = 0xFFFFFFFFFFFFFFFF


def req(start: int, uuid: int = 30, snap: tuple[int, int] | None = None, end: int = MAX
        ) -> upr.StreamRequest:  # fmt: skip
    s = snap or (start, start)
    return upr.StreamRequest(start_seqno=start, end_seqno=end, vbucket_uuid=uuid,
                             snap_start_seqno=s[0], snap_end_seqno=s[1], opaque=5)  # fmt: skip


def test_answers() -> None:
    ok = answer_stream_request(req(0, uuid=0), LOG, 150)
    assert ok == upr.StreamRequestOk(LOG, 5)
    assert answer_stream_request(req(120), LOG, 150) == upr.StreamRequestOk(LOG, 5)
    bad = answer_stream_request(req(10, end=5), LOG, 150)
    assert isinstance(bad, upr.Response) and bad.status == Status.RANGE_ERROR
    bad = answer_stream_request(req(10, snap=(11, 20)), LOG, 150)
    assert isinstance(bad, upr.Response) and bad.status == Status.RANGE_ERROR
    assert answer_stream_request(req(10, uuid=99), LOG, 150) == upr.StreamRequestRollback(0, 5)
    # Old history: agrees up to 100, a snapshot reaching past it rolls back.
    assert answer_stream_request(req(90, 20, (80, 120)), LOG, 150) == upr.StreamRequestRollback(
        80, 5
    )
    assert answer_stream_request(req(160, 30, (160, 160)), LOG, 150) == (
        upr.StreamRequestRollback(150, 5)
    )
    assert answer_stream_request(req(10), LOG, 150, purge_seqno=20) == (
        upr.StreamRequestRollback(0, 5)
    )
    # The draft's snapshot is (start, start) whatever the fields say.
    assert answer_stream_request(req(120, snap=(0, 0)), LOG, 150, draft=True) == (
        upr.StreamRequestOk(LOG, 5)
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 200), min_size=1, max_size=5, unique=True),
    st.integers(0, 250),
    st.integers(0, 250),
    st.integers(0, 250),
    st.integers(0, 250),
    st.integers(0, 6),
)
def test_rollback_never_goes_past_the_start_or_the_history(
    seqnos: list[int], high: int, a: int, b: int, c: int, pick: int
) -> None:
    seqnos = sorted(seqnos, reverse=True)
    high = max(high, seqnos[0])
    entries = tuple((100 + i, s) for i, s in enumerate(seqnos))
    snap_start, start, snap_end = sorted((a, b, c))
    uuid = 100 + pick
    got = rollback_decision(entries, high, start, uuid, snap_start, snap_end)
    if start == 0:
        assert got is None
    elif uuid not in {u for u, _ in entries}:
        assert got == 0
    elif got is not None:
        assert got <= start and got <= high
    if got is None and start and uuid in {u for u, _ in entries}:
        index = [u for u, _ in entries].index(uuid)
        upper = high if index == 0 else entries[index - 1][1]
        # 3.0 streams on when the consumer holds nothing past ``upper``: its
        # snapshot ends by then, or it is at the snapshot's start, or at its
        # end below ``upper`` (test_rollback_conform.py has the cases).
        assert snap_end <= upper or start == (start if start == snap_end else snap_start) <= upper
