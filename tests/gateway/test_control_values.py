"""CONTROL numbers read as ep-engine v3.0.0 ``parseUint32`` (src/utility.cc) reads them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from adapters.upr.producer_machine import parse_uint32

blanks = st.text(alphabet=" \t\n\r\v\f", max_size=3).map(str.encode)


@given(
    st.integers(0, 0xFFFFFFFF),
    blanks,
    st.booleans(),
    st.sampled_from([b"", b" ", b"\t", b" tail", b"\n9"]),
)
def test_a_number_with_blanks_sign_and_tail_reads_back(
    number: int, lead: bytes, plus: bool, tail: bytes
) -> None:
    text = lead + (b"+" if plus else b"") + str(number).encode() + tail
    assert parse_uint32(text) == number


@given(st.binary(max_size=12))
def test_anything_else_is_refused_never_raises(value: bytes) -> None:
    parsed = parse_uint32(value)
    if parsed is not None:
        body = value.strip().removeprefix(b"+").split(maxsplit=1)[0]
        assert body.isdigit() and int(body) == parsed <= 0xFFFFFFFF


def test_refusals() -> None:
    for value in (b"", b" ", b"-1", b"+", b"4k", b"0x10", b"4294967296", b"+-1"):
        assert parse_uint32(value) is None, value
