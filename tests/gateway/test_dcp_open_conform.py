"""UPR requests before OPEN, on the reference node and the UPR front alike
(bytes packed by ``tests.support.raw_dcp``).

ep-engine 3.0 src/ep_engine.cc: with no connection handler before OPEN,
``EvpUprStreamReq`` and the other UPR entry points return ENGINE_DISCONNECT
and memcached 3.0 daemon/memcached.c closes the connection without a reply:
one warning line here, the other connections untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, serve_upr_side
from tests.support.raw_dcp import RawDcp

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


@pytest.mark.parametrize(
    "request_bytes",
    [
        dcp.stream_req(1, opaque=4),
        dcp.frame(dcp.FAILOVER_LOG, vbucket=1, opaque=4),
        dcp.control(b"connection_buffer_size", b"1024", opaque=4),
    ],
    ids=["stream_req", "get_failover_log", "control"],
)
async def test_a_upr_request_before_open_closes_the_connection_unanswered(
    nursery: trio.Nursery,
    side: str,
    tmp_path: Path,
    request_bytes: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, port = await serve_upr_side(nursery, filled(8), side, tmp_path)
    caplog.set_level(logging.WARNING)
    with trio.fail_after(20):
        other = await RawDcp.connect(port)
        early = await RawDcp.connect(port)
        await early.send(request_bytes)
        assert await early.next() is None  # closed, no reply
        await early.aclose()
        status, pairs = await other.stats(b"")  # the other connection is served
        assert status == 0 and pairs
        await other.aclose()
    lines = [r.getMessage() for r in caplog.records if "needs an open UPR" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"opcode=0x{request_bytes[1]:02x}" in lines[0]
    assert not [r for r in caplog.records if r.exc_info]
