"""What closing a connection on a handler's failure tells the operator."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from gateway.fronts.upr.segments import LogReadError
from gateway.io.connection import PacketConnection, run_connection


async def _serve(exc: Exception) -> None:
    async def handler(conn: PacketConnection) -> None:
        raise exc

    server, client = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        await run_connection(server, handler, name="peer")
    await client.aclose()


async def test_a_fault_the_gateway_names_closes_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.io.connection")
    await _serve(LogReadError("vb-0000/1.seg: no whole record at offset 12"))
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is None
    assert record.getMessage() == (
        "peer: closing connection: vb-0000/1.seg: no whole record at offset 12"
    )


async def test_a_bug_still_closes_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.io.connection")
    await _serve(RuntimeError("bug"))
    [record] = caplog.records
    assert "internal error" in record.getMessage() and record.exc_info is not None
