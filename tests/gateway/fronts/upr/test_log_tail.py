"""The in-memory tail finds where a read starts as a bisect of the writes would.

``LogTail.start`` looks back from the end over a few writes before it bisects
(a stream that keeps up wants the last one); for any tail of writes in seqno
order and any position, it must name the first write with an item beyond it.
"""

from __future__ import annotations

import bisect

from hypothesis import given
from hypothesis import strategies as st

from gateway.fronts.upr.log_tail import LOOK_BACK, LogTail


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
