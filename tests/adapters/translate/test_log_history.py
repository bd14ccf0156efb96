"""The log's history without I/O: no seqno handed out twice, whatever the crashes.

Follows ep-engine 3.0's warmup after an unclean shutdown (``src/warmup.cc``): a
new failover entry at the proven end, so a consumer that saw more rolls back.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.translate.log_history import RESERVE_STEP, LogHistory

# (items published before the end, how it ends: clean, crash, or set aside)
RUNS = st.lists(
    st.tuples(st.integers(0, 3 * RESERVE_STEP), st.sampled_from(["clean", "crash", "lost"])),
    min_size=1,
    max_size=8,
)


@settings(max_examples=100, deadline=None)
@given(runs=RUNS, seed=st.integers(0, 2**32), data=st.data())
def test_no_seqno_is_handed_out_twice_and_every_history_starts_above_what_was_seen(
    runs: list[tuple[int, str]], seed: int, data: st.DataObject
) -> None:
    history = LogHistory(random.Random(seed))
    history.begin()
    reserved = history.reservation_due(0, force=True)
    assert reserved is not None
    history.reserved = reserved  # made durable by the log
    high = 0  # the highest seqno the log handed out (published) so far
    seen = 0  # the highest any consumer may have been served
    for published, end in runs:
        for seqno in range(high + 1, high + published + 1, RESERVE_STEP // 3 or 1):
            due = history.reservation_due(seqno)
            if seqno > history.reserved:
                assert due is not None and due > seqno
                history.reserved = due
            else:
                assert due is None
        if published:
            due = history.reservation_due(high + published)
            if due is not None:
                history.reserved = due
            high += published
        assert history.reserved >= high  # durable before published
        seen = max(seen, high)
        if end == "clean":  # the history continues: the next seqno follows ``high``
            continue
        if end == "crash":  # the disk kept a prefix of what was published
            proven = data.draw(st.integers(0, high))
            entries = len(history.failover)
            uuid, at, next_after = history.reconcile_unclean(proven)
            assert not history.continued and len(history.failover) == entries + 1
            assert history.failover.entries[0] == (uuid, at) and at >= proven
            assert next_after >= seen  # new items never reuse a seqno served before
            high = next_after
        else:  # set aside: the bound is what the reservation remembers
            uuids = {u for u, _ in history.failover.entries}
            uuid = max(uuids) + 1
            history.start_over(history.reserved, uuid)
            assert list(history.failover.entries) == [(uuid, history.reserved)]
            assert history.refetch and not history.continued
            assert history.reserved >= seen
            high = history.reserved
