"""An unknown request from the TAP upstream is answered, and the stream goes on.

A 2.5.1 node consuming TAP is memcached: a request opcode it has no executor
for goes to the engine (daemon/memcached.c ``dispatch_bin_command`` ->
``process_bin_packet`` -> ``process_bin_unknown_packet``), and ep-engine's
``processUnknownCommand`` (src/ep_engine.cc) answers UNKNOWN_COMMAND with an
empty body; nothing closes the connection, and what follows is applied. The
UPR front's ingest did log the frame as malformed and reconnect (the
producer then resent everything unacked); it now answers the same status,
logs one line per opcode and goes on. A response opcode it does not know
still closes, as memcached's ``try_read_command`` closes on one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from gateway.fronts.upr.ingest import log as ingest_log
from tests.support import tap251 as t
from tests.support.fronts import items_of, served_items, upr_front_over_251
from tests.support.tap251 import Session, Tap251Node, backfill

UNKNOWN = 0x49  # past the TAP opcodes (0x40..0x47); no 2.x engine command
UNKNOWN_COMMAND = 0x81


def unknown_request(opaque: int) -> bytes:
    """A request with extras, key and value, all of which must be skipped."""
    body = b"\x00" * 8 + b"key" + b"value"
    header = bytes([0x80, UNKNOWN, 0, 3, 8, 0, 0, 1]) + len(body).to_bytes(4, "big")
    return header + opaque.to_bytes(4, "big") + bytes(8) + body


@pytest.mark.parametrize("capture", [False, True], ids=["fast", "events"])
async def test_an_unknown_request_is_answered_and_the_stream_goes_on(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, capture: bool
) -> None:
    done = trio.Event()
    items = {vb: [(b"k%d" % vb, b"v")] for vb in (1, 2)}

    async def play(s: Session) -> None:
        await backfill(s, items)
        before = t.mutation(1, b"before", b"b", seqno=s.next(), cas=7, rev_seqno=2)
        after = t.mutation(1, b"after", b"a", seqno=s.next(), cas=8, ack=True)
        # twice in one read and once more: answered each time, logged once
        await s.send(before, unknown_request(901), unknown_request(902))
        await s.send_acked(unknown_request(903), after)
        done.set()

    node = Tap251Node(play)
    kw = {"capture_dir": tmp_path / "capture"} if capture else {}
    with trio.fail_after(20):
        front, port = await upr_front_over_251(nursery, tmp_path, node, **kw)
        await done.wait()
        got = await served_items(port, 1, 3)
    assert [e.key for e in items_of(got)] == [b"k1", b"before", b"after"]
    assert len(node.sessions) == 1  # no reconnect
    answers = [r for r in node.sessions[0].responses if r.opcode == UNKNOWN]
    assert [(r.opaque, r.status, r.body) for r in answers] == [
        (901, UNKNOWN_COMMAND, b""),
        (902, UNKNOWN_COMMAND, b""),
        (903, UNKNOWN_COMMAND, b""),
    ]
    assert front.stats.protocol_errors_total["upr_front", "upstream_unknown_opcode"] == 3
    said = [r.getMessage() for r in caplog.records if r.name == ingest_log.name]
    assert len([m for m in said if "opcode=0x49" in m and "field=opcode" in m]) == 1


async def test_an_unknown_response_still_closes(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    items = {vb: [(b"k%d" % vb, b"v")] for vb in (1, 2)}
    backfilled = trio.Event()

    async def play(s: Session) -> None:
        if len(node.sessions) == 1:
            await backfill(s, items)
            backfilled.set()
            response = bytes([0x81, UNKNOWN]) + bytes(22)
            await s.send(response)

    node = Tap251Node(play)
    with trio.fail_after(20):
        await upr_front_over_251(nursery, tmp_path, node)
        await backfilled.wait()
        await node.sessions[0].closed.wait()
    said = [r.getMessage() for r in caplog.records if "opcode=0x49" in r.getMessage()]
    assert said
