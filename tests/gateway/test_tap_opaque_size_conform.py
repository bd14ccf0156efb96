"""An OPAQUE whose engine-specific length is not 4 is logged and the stream goes on.

ep-engine 2.5.1 src/ep_engine.cc ``tapNotify``, case TAP_OPAQUE: the code is
read only when ``nengine == sizeof(uint32_t)``; any other length logs "Received
tap opaque with unknown size" and breaks out with ENGINE_SUCCESS, so the
message is acked when it asked (daemon/memcached.c ``process_bin_tap_packet``)
and nothing closes. Both TAP consumers here (the node's receiver and the UPR
front's ingest) now do so through ``adapters.tap.consumer_machine``: one
warning line naming the peer, the opcode, the field and its value, nothing
applied (an INITIAL_VBUCKET_STREAM code in such a packet resets nothing).
"""

from __future__ import annotations

import logging
import struct
import time
from pathlib import Path

import pytest
import trio

from adapters.tap import OpaqueCode, TapFlags, TapMutation, TapOpaque, TapOpcode, TapResponse
from gateway.node.items import VBucketState
from gateway.node.store import Store
from tests.gateway.node.test_node_tap_receiver import exchange
from tests.support import tap251 as t
from tests.support.fronts import items_of, served_items, upr_front_over_251
from tests.support.tap251 import Session, Tap251Node, backfill
from tests.support.tap_client import TapClient, start_node

ACK = TapFlags.ACK
INITIAL = OpaqueCode.INITIAL_VBUCKET_STREAM


def sized_opaque(vbucket: int, code: int, es_len: int, *, seqno: int, code_bytes: bool) -> bytes:
    """An OPAQUE as a faulty producer packs it: TAP header with ``es_len``, then the
    4 code bytes or none, asking for an ack."""
    body = struct.pack(">HHB3x", es_len, t.FLAG_ACK, t.TTL)
    if code_bytes:
        body += struct.pack(">I", code)
    header = struct.pack(">BBHBBHIIQ", 0x80, t.OPAQUE, 0, 8, 0, vbucket, len(body), seqno, 0)
    return header + body


def warned(caplog: pytest.LogCaptureFixture, es_len: int) -> list[str]:
    words = ("opcode=0x44", "field=engine_specific_length", f"value={es_len}")
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and all(w in r.getMessage() for w in words)
    ]


async def test_the_node_acks_it_resets_nothing_and_goes_on(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(4, initial_state=VBucketState.REPLICA)
    now = time.time()
    store.apply_mutation(1, b"kept", b"v", flags=0, expiration=0, cas=1, rev_seqno=1, now=now)
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        async with await TapClient.open(port) as client:
            await client.send(sized_opaque(1, INITIAL, 0, seqno=1, code_bytes=False))
            replies = await exchange(
                client,
                TapOpaque(INITIAL, 1, opaque=2, tap_flags=ACK, engine_specific_length=8),
                TapMutation(b"after", b"v", 1, opaque=3, rev_seqno=1, tap_flags=ACK),
            )
    assert replies == [
        TapResponse(TapOpcode.OPAQUE, 1),
        TapResponse(TapOpcode.OPAQUE, 2),
        TapResponse(TapOpcode.MUTATION, 3),
    ]
    assert store.lookup(1, b"kept") is not None  # not reset
    assert store.lookup(1, b"after") is not None
    assert len(warned(caplog, 0)) == 1 and len(warned(caplog, 8)) == 1
    assert "127.0.0.1" in warned(caplog, 8)[0]  # the peer


async def test_the_ingest_acks_it_logs_nothing_and_does_not_reconnect(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    done = trio.Event()
    items = {vb: [(b"k%d" % vb, b"v")] for vb in (1, 2)}

    async def play(s: Session) -> None:
        await backfill(s, items)
        await s.send_acked(sized_opaque(1, INITIAL, 0, seqno=s.next(), code_bytes=False))
        await s.send_acked(sized_opaque(1, INITIAL, 8, seqno=s.next(), code_bytes=True))
        await s.send_acked(t.mutation(1, b"after", b"a", seqno=s.next(), cas=8, ack=True))
        done.set()

    node = Tap251Node(play)
    with trio.fail_after(20):
        front, port = await upr_front_over_251(nursery, tmp_path, node)
        await done.wait()
        got = items_of(await served_items(port, 1, 2))
    assert [(e.key, e.by_seqno) for e in got] == [(b"k1", 1), (b"after", 2)]  # not reset
    assert len(node.sessions) == 1  # no reconnect
    assert all(r.status == 0 for r in node.sessions[0].responses)
    assert len(warned(caplog, 0)) == 1 and len(warned(caplog, 8)) == 1
    assert front.ingest.address in warned(caplog, 8)[0]  # the peer
