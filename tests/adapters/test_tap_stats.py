"""One list of ``STAT tap`` names for the node and the TAP front (ep-engine 2.x
ep_engine.cc ``doTapStats`` and tapconnection.cc ``TapProducer::addStats``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.tap import ConnectFlags
from adapters.tap.stats import CONNECTION, TOTALS, flag_names, seconds, tap_group

values = st.one_of(st.booleans(), st.integers(min_value=0), st.text(max_size=8))


@given(
    st.dictionaries(st.sampled_from(TOTALS), values),
    st.dictionaries(
        st.text(min_size=1, max_size=6), st.dictionaries(st.sampled_from(CONNECTION), values)
    ),
)
def test_any_figures_come_out_in_the_one_order(
    totals: dict[str, object], connections: dict[str, dict[str, object]]
) -> None:
    pairs = tap_group(totals, connections)
    assert len(pairs) == len(totals) + sum(map(len, connections.values()))
    head = [name.removeprefix("ep_tap_") for name, _ in pairs[: len(totals)]]
    assert head == [name for name in TOTALS if name in totals]
    rest = iter(pairs[len(totals) :])
    for conn, figures in connections.items():
        names = [name for name in CONNECTION if name in figures]
        for stat in names:
            key, text = next(rest)
            assert key == f"eq_tapq:{conn}:{stat}"
            value = figures[stat]
            expected = ("true" if value else "false") if isinstance(value, bool) else str(value)
            assert text == expected


def test_a_name_off_the_list_is_refused() -> None:
    with pytest.raises(KeyError):
        tap_group({}, {"c": {"snapshots_sent": 1}})
    with pytest.raises(KeyError):
        tap_group({"count": 1, "connections": 2}, {})


def test_flag_names_and_seconds_as_2x_printed_them() -> None:
    assert flag_names(ConnectFlags(0)) == "none"
    assert flag_names(ConnectFlags.BACKFILL | ConnectFlags.SUPPORT_ACK) == "backfill,support_ack"
    assert seconds(5.0) == "5"
    assert seconds(0.25) == "0.25"
