"""STREAM_REQ as the 3.0 producer answers it, on the reference node and the
UPR front alike, with requests packed byte by byte (``tests.support.raw_dcp``).

ep-engine 3.0 src/upr-producer.cc ``UprProducer::streamRequest``: the LATEST
flag (0x04) replaces the end seqno with the vbucket's high seqno, and
DISKONLY (0x02) with the last persisted seqno, whatever end the consumer
sent, before the range checks (start > end is ERANGE).
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import trio

from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, high_seqno, serve_upr_side
from tests.support.raw_dcp import producer, read_stream

ERANGE = 0x22

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


@pytest.mark.parametrize("flag", [dcp.LATEST, dcp.DISKONLY])
@pytest.mark.parametrize("end", [0, 3, dcp.MAX_SEQNO])
async def test_latest_and_diskonly_replace_the_end_the_consumer_sent(
    nursery: trio.Nursery, side: str, tmp_path: Path, flag: int, end: int
) -> None:
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 1)
    assert high > 3
    with trio.fail_after(20):
        client = await producer(port, b"latest-end")
        await client.send(dcp.stream_req(1, opaque=10, end=end, flags=flag))
        assert (await client.response(10)).status == 0
        store.set(1, b"too-late", b"x", now=time.time())
        messages = await read_stream(client, 10)
        await client.aclose()
    seqnos = [m.by_seqno for m in messages if m.opcode == dcp.MUTATION]
    assert seqnos[-1] == high and len(seqnos) == 10
    assert struct.unpack(">I", messages[-1].extras)[0] == 0  # STREAM_END OK


@pytest.mark.parametrize("flag", [dcp.LATEST, dcp.DISKONLY])
async def test_a_start_past_the_high_seqno_with_latest_is_a_range_error(
    nursery: trio.Nursery, side: str, tmp_path: Path, flag: int
) -> None:
    """The replaced end is checked as any end: start > end is ERANGE, before the
    rollback rule is asked (an unknown uuid would otherwise roll back to 0)."""
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    start = high_seqno(server, 1) + 5
    with trio.fail_after(20):
        client = await producer(port, b"latest-range")
        await client.send(dcp.stream_req(1, opaque=11, start=start, uuid=0xBAD, flags=flag))
        assert (await client.response(11)).status == ERANGE
        # The connection stays: a plain request on it is answered.
        await client.send(dcp.stream_req(1, opaque=12))
        assert (await client.response(12)).status == 0
        await client.aclose()


@pytest.mark.parametrize("end", [0, 3])
async def test_a_takeover_stream_runs_past_the_end_the_consumer_sent(
    nursery: trio.Nursery, side: str, tmp_path: Path, end: int
) -> None:
    """ep-engine 3.0 src/upr-stream.cc ``ActiveStream::ActiveStream``: a takeover
    stream's end seqno is the largest there is, whatever the request said (the
    request's own range is checked first): it sends everything, hands the
    vbucket over (SET_VBUCKET_STATE pending, then active) and ends OK."""
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    high = high_seqno(server, 1)
    with trio.fail_after(30):
        client = await producer(port, b"taker-end")
        await client.send(dcp.stream_req(1, opaque=10, end=end, flags=dcp.TAKEOVER))
        assert (await client.response(10)).status == 0
        messages = await read_stream(client, 10)
        await client.aclose()
    seqnos = [m.by_seqno for m in messages if m.opcode == dcp.MUTATION]
    assert seqnos[-1] == high
    states = [m.extras for m in messages if m.opcode == dcp.SET_VBUCKET_STATE]
    assert states == [b"\x03", b"\x01"]  # pending, then active
    assert struct.unpack(">I", messages[-1].extras)[0] == 0  # STREAM_END OK
