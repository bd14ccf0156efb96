"""A CONTROL key sent with its C string's NUL, on the reference node and the
UPR front alike (bytes packed by ``tests.support.raw_dcp``).

ep-engine 3.0 src/upr-producer.cc ``UprProducer::control`` matches keys with
``strncmp(param, "connection_buffer_size", nkey)``: a key of
``sizeof("connection_buffer_size")`` bytes, NUL included, is that key, and
the buffer size takes effect.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.support import raw_dcp as dcp
from tests.support.fronts import filled, serve_upr_side
from tests.support.raw_dcp import producer, stats

pytestmark = pytest.mark.parametrize("side", ["node", "front"])


async def test_a_control_key_with_its_nul_names_the_key(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    _, port = await serve_upr_side(nursery, filled(8), side, tmp_path)
    with trio.fail_after(20):
        client = await producer(port, b"c-client")
        await client.send(dcp.control(b"connection_buffer_size\x00", b"4096", opaque=2))
        assert (await client.response(2)).status == 0
        status, pairs = await stats(port, b"dcp")
        await client.aclose()
    assert status == 0 and pairs["eq_dcpq:c-client:max_buffer_bytes"] == "4096"
