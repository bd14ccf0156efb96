"""A consumer's stray response on a producer connection, on the reference node
and the UPR front alike (bytes packed by ``tests.support.raw_dcp``).

ep-engine 3.0 src/upr-producer.cc ``UprProducer::handleResponse`` drops the
connection on a response it does not expect ("Trying to handle an unknown
response"): one warning line naming the opcode, that connection closed, the
other consumers untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, high_seqno, serve_upr_side
from tests.support.raw_dcp import producer, read_stream

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


@pytest.mark.parametrize("opcode", [dcp.CONTROL, dcp.STREAM_REQ, dcp.NOOP])
async def test_a_stray_response_closes_that_connection_only(
    nursery: trio.Nursery,
    side: str,
    tmp_path: Path,
    opcode: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    caplog.set_level(logging.WARNING)
    with trio.fail_after(20):
        other = await producer(port, b"bystander")
        stray = await producer(port, b"stray")
        # A reply to a STREAM_END is taken and ignored, the connection stays.
        await stray.send(dcp.frame(dcp.STREAM_END, magic=dcp.RES, opaque=3))
        await stray.send(dcp.frame(opcode, magic=dcp.RES, opaque=0x0BAD))
        while (got := await stray.next()) is not None:
            assert got.magic == dcp.RES  # nothing but the answers before the close
        await stray.aclose()
        await other.send(dcp.stream_req(1, opaque=10, end=high_seqno(server, 1)))
        assert (await other.response(10)).status == 0
        messages = await read_stream(other, 10)
        assert messages[-1].opcode == dcp.STREAM_END
        await other.aclose()
    lines = [
        r.getMessage() for r in caplog.records if "not one a producer expects" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    assert f"opcode=0x{opcode:02x}" in lines[0]
    assert not [r for r in caplog.records if r.exc_info]  # no traceback
