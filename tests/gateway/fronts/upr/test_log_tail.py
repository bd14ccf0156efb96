"""The in-memory tail finds where a read starts as a bisect of the writes would.

``LogTail.start`` looks back from the end over a few writes before it bisects
(a stream that keeps up wants the last one); for any tail of writes in seqno
order and any position, it must name the first write with an item beyond it.
"""

from __future__ import annotations

import bisect
import gc

from hypothesis import given
from hypothesis import strategies as st

from gateway.fronts.upr.log_tail import KEEP_BYTES, LOOK_BACK, LogTail, TailBudget


@st.composite
def _tails(draw: st.DrawFn) -> tuple[LogTail, int]:
    sizes = draw(st.lists(st.integers(1, 3), max_size=3 * LOOK_BACK))
    tail = LogTail(1 << 30)
    seqno = draw(st.integers(0, 5))
    for size in sizes:
        first = seqno + draw(st.integers(1, 3))  # gaps: seqnos a write never names
        seqno = first + size - 1
        tail.chunks.append((first, seqno, b""))
    return tail, draw(st.integers(0, seqno + 3))


@given(_tails())
def test_start_is_the_bisect_of_the_writes(case: tuple[LogTail, int]) -> None:
    tail, after = case
    expected = bisect.bisect_right([last for _, last, _ in tail.chunks], after)
    assert tail.start(after) == expected


def _write(tail: LogTail, first: int, size: int) -> None:
    tail.add([(first, first, bytes(size))])


def test_tails_grow_within_the_shared_budget() -> None:
    """A tail keeps ``KEEP_BYTES`` whatever the others hold and grows to its limit while
    all tails hold under the budget beyond their keep; past it, the tails written least
    lately give back what they hold beyond their keep (``log_tail``'s memory figures)."""
    budget = TailBudget(limit=3 * KEEP_BYTES)
    tails = [LogTail(4 * KEEP_BYTES, budget=budget) for _ in range(3)]
    for seqno in range(1, 9):  # each tail gets 2 x its keep: the budget holds all of it
        for tail in tails:
            _write(tail, seqno, KEEP_BYTES // 4)
    assert [t.size for t in tails] == [2 * KEEP_BYTES] * 3
    assert budget.total == 3 * KEEP_BYTES
    for seqno in range(9, 17):  # the last one grows: the least lately written give back
        _write(tails[2], seqno, KEEP_BYTES // 4)
    assert tails[2].size == 4 * KEEP_BYTES
    assert [t.size for t in tails[:2]] == [KEEP_BYTES, KEEP_BYTES]
    assert budget.total == 3 * KEEP_BYTES
    assert tails[0].floor == 4 and tails[0].start(4) == 0  # the oldest writes went
    for seqno in range(17, 40):  # never beyond its own limit
        _write(tails[2], seqno, KEEP_BYTES // 4)
    assert tails[2].size <= 4 * KEEP_BYTES
    del tails[2], tail  # a log gone: its bytes leave the budget
    gc.collect()
    assert budget.total == 0


def test_a_small_tail_never_grows() -> None:
    budget = TailBudget()
    tail = LogTail(1000, budget=budget)
    for seqno in range(1, 20):
        _write(tail, seqno, 300)
    assert tail.size <= 1000 and budget.total == 0
