"""STREAM_REQ and CLOSE_STREAM details the first pass left unpinned, on the
reference node and the UPR front alike, with requests packed byte by byte.

ep-engine 3.0 src/upr-producer.cc ``UprProducer::streamRequest``: LATEST
(0x04) sets the end seqno to the vbucket's high seqno, DISKONLY (0x02) to the
last persisted seqno, then start > end is ERANGE, and only after the range
checks does a live stream on the vbucket make it KEY_EEXISTS.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import trio

from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, high_seqno, serve_upr_side
from tests.support.raw_dcp import producer, read_stream, stats

ERANGE, KEY_EEXISTS, KEY_ENOENT = 0x22, 0x02, 0x01

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


@pytest.mark.parametrize("flag", [dcp.LATEST, dcp.DISKONLY])
async def test_a_start_past_the_high_seqno_with_latest_is_a_range_error_while_streaming(
    nursery: trio.Nursery, side: str, tmp_path: Path, flag: int
) -> None:
    server, port = await serve_upr_side(nursery, filled(40), side, tmp_path)
    high = high_seqno(server, 1)
    with trio.fail_after(20):
        client = await producer(port, b"latest-live")
        await client.send(dcp.stream_req(1, opaque=10))  # open-ended: stays live
        assert (await client.response(10)).status == 0
        await client.send(dcp.stream_req(1, opaque=11, start=high + 1, end=high + 9, flags=flag))
        assert (await client.response(11)).status == ERANGE
        # A start the replaced end allows meets the live stream.
        await client.send(dcp.stream_req(1, opaque=12, start=high, end=0, flags=flag))
        assert (await client.response(12)).status == KEY_EEXISTS
        await client.aclose()


async def test_a_stream_with_nothing_to_send_ends_at_once_without_a_marker(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine 3.0 src/upr-stream.cc ``ActiveStream::ActiveStream``: a start at
    or past the end seqno ends the stream OK as it is made, before any marker."""
    _, port = await serve_upr_side(nursery, filled(40), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"empty")
        await client.send(dcp.stream_req(1, opaque=10, start=0, end=0))
        assert (await client.response(10)).status == 0
        messages = await read_stream(client, 10)
        assert [m.opcode for m in messages] == [dcp.STREAM_END]
        assert struct.unpack(">I", messages[0].extras)[0] == 0
        await client.aclose()


async def test_close_stream_erases_the_stream_from_stat_dcp(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine 3.0 src/upr-producer.cc ``UprProducer::closeStream`` erases the
    stream from the connection's map whether it was live (OK) or had ended
    (KEY_ENOENT), so ``addStats`` lists it no more; a stream that ended by
    itself stays listed, dead, until then."""
    server, port = await serve_upr_side(nursery, filled(40), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"erased")
        await client.send(dcp.stream_req(1, opaque=10))
        assert (await client.response(10)).status == 0
        await client.send(dcp.stream_req(2, opaque=11, end=high_seqno(server, 2)))
        assert (await client.response(11)).status == 0
        await read_stream(client, 11)
        head = "eq_dcpq:erased:"
        _, pairs = await stats(port, b"dcp")
        assert pairs[head + "stream_2_state"] == "dead" and head + "stream_1_state" in pairs
        await client.send(dcp.close_stream(1, opaque=12))
        assert (await client.response(12)).status == 0
        await client.send(dcp.close_stream(2, opaque=13))
        assert (await client.response(13)).status == KEY_ENOENT
        _, pairs = await stats(port, b"dcp")
        assert not [k for k in pairs if k.startswith(head + "stream_")]
        await client.send(dcp.close_stream(2, opaque=14))
        assert (await client.response(14)).status == KEY_ENOENT
        await client.aclose()
