"""STREAM_REQ checks on a vbucket that already streams, on the reference node
and the UPR front alike, with requests packed byte by byte.

ep-engine 3.0 src/upr-producer.cc ``UprProducer::streamRequest``: LATEST
(0x04) sets the end seqno to the vbucket's high seqno, DISKONLY (0x02) to the
last persisted seqno, then start > end is ERANGE, and only after the range
checks does a live stream on the vbucket make it KEY_EEXISTS.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.gateway.test_dcp_3x_clients import filled, high_seqno, producer, serve
from tests.support import raw_dcp as dcp

ERANGE, KEY_EEXISTS = 0x22, 0x02

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


@pytest.mark.parametrize("flag", [dcp.LATEST, dcp.DISKONLY])
async def test_a_start_past_the_high_seqno_with_latest_is_a_range_error_while_streaming(
    nursery: trio.Nursery, side: str, tmp_path: Path, flag: int
) -> None:
    server, port = await serve(nursery, filled(40), side, tmp_path)
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
