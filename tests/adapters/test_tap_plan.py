"""The TAP CONNECT rules both TAP producers share (``adapters.tap.plan``).

Precedence as ep-engine 2.x's ep_engine.cc ``createTapQueue`` applied it: a
registered position, then DUMP, then the CHECKPOINT map, then BACKFILL by
date, then live; the vbucket filter of vbucket.hh ``VBucketFilter``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp import Status
from adapters.tap import ConnectFlags, TapConnect
from adapters.tap.plan import Start, connect_vbuckets, skipped_vbuckets, start_of

NOW = 1_000_000.0
FLAGS = [ConnectFlags.DUMP, ConnectFlags.CHECKPOINT, ConnectFlags.BACKFILL]
DATES = st.sampled_from([None, 0, int(NOW) - 1, int(NOW), int(NOW) + 1, (1 << 64) - 1])


def flags_of(chosen: list[ConnectFlags]) -> ConnectFlags:
    out = ConnectFlags(0)
    for flag in chosen:
        out |= flag
    return out


@given(
    st.lists(st.sampled_from(FLAGS), unique=True),
    st.booleans(),
    st.booleans(),
    DATES,
)
def test_each_vbucket_starts_by_the_first_rule_that_applies(
    chosen: list[ConnectFlags], registered: bool, in_map: bool, date: int | None
) -> None:
    flags = flags_of(chosen)
    connect = TapConnect(b"c", flags, backfill_date=date, checkpoints=((3, 7),) if in_map else ())
    rules = [
        (registered, Start.RESUME),
        (ConnectFlags.DUMP in flags, Start.DUMP),
        (ConnectFlags.CHECKPOINT in flags and in_map, Start.CHECKPOINT),
        (ConnectFlags.BACKFILL in flags and (date or 0) <= NOW, Start.BACKFILL),
        (True, Start.LIVE),
    ]
    expected = next(start for applies, start in rules if applies)
    got = start_of(
        connect,
        3,
        registered={3} if registered else set(),
        checkpoints=dict(connect.checkpoints),
        now=NOW,
    )
    assert got is expected


@given(st.lists(st.integers(0, 11), max_size=6))
def test_listed_vbuckets_in_order_once_each_or_every_active_one(listed: list[int]) -> None:
    """A listed vbucket the producer lacks (8 and up here) is skipped, as ep-engine
    2.x src/tapconnection.cc ``TapProducer::registerCursor`` did."""
    connect = TapConnect(b"c", ConnectFlags.LIST_VBUCKETS, vbuckets=tuple(listed))
    got = connect_vbuckets(connect, range(8), [1, 4])
    once = tuple(dict.fromkeys(listed))
    assert got == (tuple(vb for vb in once if vb < 8) if listed else (1, 4))
    assert skipped_vbuckets(connect, range(8)) == tuple(vb for vb in once if vb >= 8)


@pytest.mark.parametrize(
    ("connect", "field"),
    [
        (
            TapConnect(
                b"c",
                ConnectFlags.TAKEOVER_VBUCKETS | ConnectFlags.DUMP | ConnectFlags.LIST_VBUCKETS,
                vbuckets=(1,),
            ),
            "flags",
        ),
        (TapConnect(b"c", ConnectFlags.TAKEOVER_VBUCKETS), "flags"),
    ],
)
def test_a_connect_the_producer_cannot_honour_is_refused(connect: TapConnect, field: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        connect_vbuckets(connect, range(8), [])
    assert refused.value.status == Status.NOT_SUPPORTED
    assert refused.value.field == field
