"""A consumer's own requests sent to a producer, on the reference node and the
UPR front alike (bytes packed by ``tests.support.raw_dcp``).

ep-engine 3.0 src/tapconnection.cc ``ConnHandler``: a producer connection
that gets ADD_STREAM, a stream message or UPR's NOOP logs "Disconnecting -
This connection doesn't support the ... API" and returns ENGINE_DISCONNECT,
as a later 3.x src/ep_engine.cc ``dcpOpen`` does for a second OPEN ("another
connection exists on the same socket"; 3.0.0's ``uprOpen`` put a second
handler over the first); memcached 3.0 daemon/memcached.c closes the
connection without a reply. The other consumers stream on.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import trio

from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, high_seqno, serve_upr_side
from tests.support.raw_dcp import producer, read_stream

pytestmark = pytest.mark.parametrize("side", ["node", "front"])

MUTATION_EXTRAS = struct.pack(">QQIIIHB", 1, 1, 0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    "request_bytes",
    [
        dcp.frame(dcp.NOOP, opaque=5),
        dcp.frame(dcp.MUTATION, extras=MUTATION_EXTRAS, key=b"k", value=b"v", vbucket=1),
        dcp.frame(dcp.SET_VBUCKET_STATE, extras=b"\x01", vbucket=1),
        dcp.frame(dcp.ADD_STREAM, extras=b"\0\0\0\0", vbucket=1),
        dcp.open_producer(b"again", opaque=6),
    ],
    ids=["noop", "mutation", "set_vbucket_state", "add_stream", "second_open"],
)
async def test_a_consumer_request_closes_a_producer_connection_unanswered(
    nursery: trio.Nursery,
    side: str,
    tmp_path: Path,
    request_bytes: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = filled(40)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    caplog.set_level(logging.WARNING)
    with trio.fail_after(20):
        other = await producer(port, b"bystander")
        wrong = await producer(port, b"wrong-way")
        await wrong.send(request_bytes)
        assert await wrong.next() is None  # closed, no reply
        await wrong.aclose()
        await other.send(dcp.stream_req(1, opaque=10, end=high_seqno(server, 1)))
        assert (await other.response(10)).status == 0
        assert (await read_stream(other, 10))[-1].opcode == dcp.STREAM_END
        await other.aclose()
    lines = [
        r.getMessage()
        for r in caplog.records
        if "not a producer" in r.getMessage() or "open already" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    assert f"opcode=0x{request_bytes[1]:02x}" in lines[0]
    assert not [r for r in caplog.records if r.exc_info]
