"""cbbackup's TAP source (couchbase-cli 2.x ``pump_tap.py``), emulated byte for byte.

``TAPDumpSource`` is the backup tool of the 2.x releases: one TAP DUMP per
node, read by hand-written framing that is stricter than the servers' other
clients. These tests send exactly what it sends and read the answers as its
``read_tap_conn``/``recv_msg``/``provide_batch_actual`` do, on the reference
node and on the TAP front: every packet must be a request (magic 0x80, else
it raises), of the opcodes it knows (any other, CHECKPOINT_START included,
ends the backup with "unexpected TAP message"), with 8 or 16 bytes of extras
and the engine-specific bytes before the key; the dump ends cleanly only when
the server closes right after a message the tool acked.
"""

from __future__ import annotations

import struct

import pytest
import trio

from adapters.mcbp import Frame
from gateway.node.store import Store
from tests.support.fronts import serve_tap_side
from tests.support.tap_client import TapClient

pytestmark = pytest.mark.parametrize("side", ["node", "front"])

REQ_PKT_FMT = struct.Struct(">BBHBBHIIQ")
"""memcacheConstants.REQ_PKT_FMT (RES_PKT_FMT packs the same fields)."""
TAP_GENERAL_PKT_FMT = struct.Struct(">HHB3x")
TAP_MUTATION_PKT_FMT = struct.Struct(">HHB3xII")
CMD_NOOP, CMD_TAP_CONNECT, CMD_TAP_MUTATION, CMD_TAP_DELETE = 0x0A, 0x40, 0x41, 0x42
CMD_TAP_FLUSH, CMD_TAP_OPAQUE = 0x43, 0x44
TAP_FLAG_DUMP, TAP_FLAG_SUPPORT_ACK, TAP_FLAG_TAP_FIX_FLAG_BYTEORDER = 0x02, 0x10, 0x100
TAP_FLAG_ACK = 0x01
VBUCKETS = 4


def tap_connect(name: bytes) -> bytes:
    """``get_tap_conn`` for a 2.0+ server: ``encode_tap_connect_opts`` of DUMP,
    SUPPORT_ACK and TAP_FIX_FLAG_BYTEORDER, each with '' as its value, sent by
    mc_bin_client ``_sendCmd(CMD_TAP_CONNECT, name, val, 0, ext)``."""
    flags = TAP_FLAG_DUMP | TAP_FLAG_SUPPORT_ACK | TAP_FLAG_TAP_FIX_FLAG_BYTEORDER
    ext = struct.pack(">I", flags)
    return REQ_PKT_FMT.pack(0x80, CMD_TAP_CONNECT, len(name), 4, 0, 0, len(name) + 4, 0, 0) + (
        ext + name
    )


def ack(cmd: int, opaque: int) -> bytes:
    """``_sendMsg(cmd, '', '', opaque, vbucketId=0, fmt=RES_PKT_FMT, magic=RES_MAGIC_BYTE)``."""
    return REQ_PKT_FMT.pack(0x81, cmd, 0, 0, 0, 0, 0, opaque, 0)


def read_tap_conn(frame: Frame) -> tuple[int, int, bytes, int, int, bytes, int, bool]:
    """``recv_msg`` + ``read_tap_conn``: (cmd, vbucket, key, flg, exp, val, opaque,
    need_ack); extras of 8 or 16 bytes name the engine-specific length that sits
    before the key."""
    assert frame.magic == 0x80, "unexpected recv_msg magic"
    data, extlen = frame.body, frame.extras_length
    metalen = flags = flg = exp = 0
    if data:
        ext = data[:extlen]
        if extlen == 8:
            metalen, flags, _ttl = TAP_GENERAL_PKT_FMT.unpack(ext)
        elif extlen == 16:
            metalen, flags, _ttl, flg, exp = TAP_MUTATION_PKT_FMT.unpack(ext)
    key_start = extlen + metalen
    key = data[key_start : key_start + frame.key_length]
    val = data[key_start + frame.key_length :]
    return (
        frame.opcode, frame.vbucket_or_status, key, flg, exp, val, frame.opaque,
        bool(flags & TAP_FLAG_ACK),
    )  # fmt: skip


def store_of(items: int) -> Store:
    store = Store(VBUCKETS)
    for i in range(items):
        store.set(i % VBUCKETS, b"doc-%05d" % i, b"body-%d" % i, flags=0x2000006, now=1000.0)
    store.delete(1, b"doc-00001", now=1001.0)
    return store


async def test_tap_dump_source_backs_up_every_item_and_ends_cleanly(
    nursery: trio.Nursery, side: str
) -> None:
    """couchbase-cli 2.x pump_tap.py ``TAPDumpSource.provide_batch_actual``: only
    MUTATION, DELETE, OPAQUE and NOOP are taken; an ack-flagged message is acked
    at once; the end is clean when the connection closes after an acked message
    (``ack_last``). ep-engine 2.5.1 tapconnection.cc asks an ack on every OPAQUE
    and, for a DUMP, closes once all is acked (``TapProducer::isTimeForNoop`` /
    ``doDisconnect``); flags travel as stored with FIX_FLAG_BYTEORDER."""
    store = store_of(1200)
    _, port = await serve_tap_side(nursery, store, side)
    backed_up: dict[bytes, tuple[int, bytes]] = {}
    with trio.fail_after(60):
        client = await TapClient.open(port)
        await client.send(tap_connect(b"wQpzKjHyTrxLmNoB"))
        ack_last = False
        while (frame := await client.next_frame()) is not None:
            cmd, vbucket, key, flg, exp, val, opaque, need_ack = read_tap_conn(frame)
            if cmd in (CMD_TAP_MUTATION, CMD_TAP_DELETE):
                assert exp == 0 and vbucket == int(key[4:]) % VBUCKETS
                backed_up[key] = (flg, val) if cmd == CMD_TAP_MUTATION else (0, b"<deleted>")
            else:
                assert cmd in (CMD_TAP_OPAQUE, CMD_NOOP), f"unexpected TAP message: {cmd:#x}"
            ack_last = need_ack
            if need_ack:
                await client.send(ack(cmd, opaque))
        await client.aclose()
    assert ack_last, "the dump ended on a message the tool never acked: not a clean end"
    live = {b"doc-%05d" % i: (0x2000006, b"body-%d" % i) for i in range(1200) if i != 1}
    assert {k: v for k, v in backed_up.items() if v[1] != b"<deleted>"} == live
