"""cbbackup's UPR source (couchbase-cli 3.0 ``pump_upr.py``), emulated byte for byte.

``UPRStreamSource`` (couchbase/couchbase-cli 0c4de61, the copy that sends
3.0.0's 48-byte STREAM_REQ) backs a node up over two connections: on one it
authenticates (CRAM-MD5, then PLAIN when that fails), opens a producer,
sets ``connection_buffer_size`` and requests every vbucket that ``STAT
vbucket-seqno`` on the other one lists, from what its last backup saved
(seqno, newest failover uuid, snapshot) up to the high seqno of the STAT.
Its reader thread (``run``) splits frames by the header alone; the pump
(``provide_upr_batch_actual``) takes STREAM_REQ answers, markers,
mutations, deletions, STREAM_END and NOOP, anything else ends the backup
("unexpected UPR message"), and acks the buffer every 25 % of it and at the
end of each batch of 1,000. These tests send exactly that and read the
answers so, on the reference node and on the UPR front: the client was run
as it is (Python 2.7) against both, with live writes and an incremental
resume, and got every item.
"""

from __future__ import annotations

import hmac
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.node.items import ItemKind
from gateway.node.store import Store
from tests.support.fronts import caught_up, serve_upr_side
from tests.support.raw_dcp import RawDcp, Reply
from tests.support.waiting import until

pytestmark = pytest.mark.parametrize("side", ["node", "front"])

# couchbaseConstants.py
REQ_PKT_FMT = struct.Struct(">BBHBBHIIQ")
CMD_STAT, CMD_SASL_AUTH, CMD_SASL_STEP = 0x10, 0x21, 0x22
CMD_UPR_CONNECT, CMD_UPR_REQUEST_STREAM, CMD_UPR_END_STREAM = 0x50, 0x53, 0x55
CMD_UPR_SNAPSHOT_MARKER, CMD_UPR_MUTATION, CMD_UPR_DELETE = 0x56, 0x57, 0x58
CMD_UPR_EXPIRATION, CMD_UPR_FLUSH, CMD_UPR_NOOP = 0x59, 0x5A, 0x5C
CMD_UPR_BUFFER_ACK, CMD_UPR_CONTROL = 0x5D, 0x5E
FLAG_UPR_PRODUCER = 0x01
ERR_SUCCESS, ERR_KEY_ENOENT, ERR_KEY_EEXISTS, ERR_NOT_MY_VBUCKET = 0x00, 0x01, 0x02, 0x07
ERR_AUTH_CONTINUE, ERR_ERANGE, ERR_ROLLBACK = 0x21, 0x22, 0x23
UPR_STREAM_REQ_PKT_FMT = struct.Struct(">IIQQQQQ")
UPR_MUTATION_PKT_FMT = struct.Struct(">QQIIIHB")
UPR_DELETE_PKT_FMT = struct.Struct(">QQH")
UPR_VB_UUID_SEQNO_PKT_FMT = struct.Struct(">QQ")
UPR_VB_SEQNO_PKT_FMT = struct.Struct(">Q")
UPR_SNAPSHOT_PKT_FMT = struct.Struct(">QQI")

BATCH_MAX_SIZE, BATCH_MAX_BYTES = 1000, 400_000  # cbbackup's defaults
DELTA_ACK_SIZE = BATCH_MAX_BYTES * 10 // 4
VBUCKETS = 4


def send_msg(
    cmd: int, key: bytes, val: bytes, opaque: int, extra: bytes = b"", vbucket: int = 0
) -> bytes:
    """cb_bin_client ``MemcachedClient._sendMsg`` (``_sendCmd`` passes vbucket 0)."""
    body = len(key) + len(extra) + len(val)
    return REQ_PKT_FMT.pack(0x80, cmd, len(key), len(extra), 0, vbucket, body, opaque, 0) + (
        extra + key + val
    )


async def single_response(conn: RawDcp, opaque: int) -> Reply:
    """``_handleSingleResponse``: the next frame must carry ``opaque``."""
    got = await conn.next()
    assert got is not None, "Got empty data (remote died?)."
    assert got.opaque == opaque, f"expected opaque {opaque:x}, got {got.opaque:x}"
    return got


async def authenticate(conn: RawDcp, user: bytes, password: bytes) -> int:
    """``sasl_auth_cram_md5``: the status it ends on (0 when authenticated)."""
    await conn.send(send_msg(CMD_SASL_AUTH, b"CRAM-MD5", b"", 0xC0))
    got = await single_response(conn, 0xC0)
    if got.status != ERR_AUTH_CONTINUE:
        return got.status  # MemcachedError (0 would leave no challenge to answer)
    dig = hmac.new(password, got.value, "md5").hexdigest().encode()
    await conn.send(send_msg(CMD_SASL_STEP, b"CRAM-MD5", user + b" " + dig, 0xC1))
    return (await single_response(conn, 0xC1)).status


async def plain(conn: RawDcp, user: bytes, password: bytes) -> int:
    """``sasl_auth_plain``."""
    await conn.send(send_msg(CMD_SASL_AUTH, b"PLAIN", b"\0".join([b"", user, password]), 0xC2))
    return (await single_response(conn, 0xC2)).status


def seqno_stats(stats: dict[str, str]) -> dict[str, dict[str, int]]:
    """``setup_upr_streams``: any key holding ``uuid`` or ``high_seqno`` names a
    vbucket by what lies between ``vb_`` and the character before the match."""
    vb_list: dict[str, dict[str, int]] = {}
    for key, val in stats.items():
        for name in ("uuid", "high_seqno"):
            i = key.find(name)
            if i > 0:
                vb_list.setdefault(key[3 : i - 1], {})[name] = int(val)
    return vb_list


@dataclass
class Saved:
    """What the sink keeps between runs (seqno.json, failover.json, snapshot_markers.json)."""

    seqno: dict[int, int] = field(default_factory=dict)
    failover: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    snapshot: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class Run:
    msgs: list[tuple[int, int, bytes, int, bytes, int]] = field(default_factory=list)
    """(cmd, vbucket, key, flags, value, seqno) as the pump appends them."""
    answers: dict[int, list[int]] = field(default_factory=dict)
    """STREAM_REQ statuses per vbucket, in order."""
    opcodes: set[int] = field(default_factory=set)
    acked: int = 0
    received: int = 0
    """Bytes of every frame read after the STREAM_REQs went out."""


async def open_source(port: int, name: bytes) -> tuple[RawDcp, RawDcp]:
    """``get_upr_conn`` for bucket ``default`` (no password): two connections,
    SASL, OPEN as producer and CONTROL connection_buffer_size."""
    upr_conn, mem_conn = await RawDcp.connect(port), await RawDcp.connect(port)
    if await authenticate(upr_conn, b"default", b"") or await authenticate(
        mem_conn, b"default", b""
    ):
        assert await plain(upr_conn, b"default", b"") == 0, "SASL auth failed"
        assert await plain(mem_conn, b"default", b"") == 0, "SASL auth failed"
    extra = struct.pack(">II", 0, FLAG_UPR_PRODUCER)
    await upr_conn.send(send_msg(CMD_UPR_CONNECT, name, b"", 0x0A11CE, extra))
    assert (await single_response(upr_conn, 0x0A11CE)).status == 0
    value = str(BATCH_MAX_BYTES * 10).encode()
    await upr_conn.send(send_msg(CMD_UPR_CONTROL, b"connection_buffer_size", value, 0xB0F))
    assert (await single_response(upr_conn, 0xB0F)).status == 0
    return upr_conn, mem_conn


async def backup(port: int, saved: Saved, name: bytes = b"cbbackup-4242") -> Run:
    """One cbbackup run: ``get_upr_conn``, ``setup_upr_streams``, then
    ``provide_upr_batch_actual`` until every stream has ended."""
    upr_conn, mem_conn = await open_source(port, name)
    status, stats = await mem_conn.stats(b"vbucket-seqno")
    assert status == 0 and stats, "error: fail to retrive vbucket seqno"
    await mem_conn.aclose()
    stream_list: dict[int, tuple[int, int, int, int, int, int]] = {}

    async def request(vbid: int, start: int, end: int, uuid: int, ss: tuple[int, int]) -> None:
        extra = UPR_STREAM_REQ_PKT_FMT.pack(0, 0, start, end, uuid, *ss)
        await upr_conn.send(send_msg(CMD_UPR_REQUEST_STREAM, b"", b"", vbid, extra, vbid))
        stream_list[vbid] = (vbid, start, end, uuid, *ss)

    for vbid, seqnos in seqno_stats(stats).items():
        vb = int(vbid)  # a key such as vb_1:abs_high_seqno would stop the backup here
        start = saved.seqno.get(vb, 0)
        flog = sorted(saved.failover.get(vb, []), key=lambda t: t[1], reverse=True)
        uuid = flog[0][0] if flog else 0
        ss = saved.snapshot.get(vb, (start, start))
        await request(vb, start, seqnos["high_seqno"], uuid, ss)

    run = Run()
    batch, batch_bytes, last_processed = 0, 0, 0
    while stream_list:
        if batch_bytes - last_processed > DELTA_ACK_SIZE:
            run.acked += batch_bytes - last_processed
            await upr_conn.send(
                send_msg(CMD_UPR_BUFFER_ACK, b"", b"", 0xACC,
                         struct.pack(">I", batch_bytes - last_processed))
            )  # fmt: skip
            last_processed = batch_bytes
        got = await upr_conn.next()
        assert got is not None, "Got empty data (remote died?)."
        batch_bytes += got.size
        run.received += got.size
        run.opcodes.add(got.opcode)
        cmd, errcode, opaque, data = got.opcode, got.status, got.opaque, got.value
        if cmd == CMD_UPR_REQUEST_STREAM:
            run.answers.setdefault(opaque, []).append(errcode)
            if errcode == ERR_SUCCESS:
                step = UPR_VB_UUID_SEQNO_PKT_FMT.size
                saved.failover[opaque] = [
                    UPR_VB_UUID_SEQNO_PKT_FMT.unpack_from(data, i)
                    for i in range(0, len(data) - step + 1, step)
                ]
            elif errcode in (ERR_KEY_ENOENT, ERR_NOT_MY_VBUCKET, ERR_ERANGE):
                del stream_list[opaque]
            elif errcode == ERR_ROLLBACK:
                vbid, _, end, uuid, *_ = stream_list[opaque]
                (start,) = UPR_VB_SEQNO_PKT_FMT.unpack(data)  # the whole body
                await request(vbid, start, end, uuid, (start, start))
            else:
                assert errcode == ERR_KEY_EEXISTS, f"no branch for STREAM_REQ status {errcode:#x}"
        elif cmd == CMD_UPR_MUTATION:
            seqno, _rev, flg, _exp, _lock, _metalen, _nru = UPR_MUTATION_PKT_FMT.unpack(got.extras)
            run.msgs.append((cmd, errcode, got.key, flg, got.value, seqno))
        elif cmd in (CMD_UPR_DELETE, CMD_UPR_EXPIRATION):
            seqno, _rev, _metalen = UPR_DELETE_PKT_FMT.unpack(got.extras)
            run.msgs.append((cmd, errcode, got.key, 0, b"", seqno))
        elif cmd == CMD_UPR_END_STREAM:
            del stream_list[opaque]
        elif cmd == CMD_UPR_SNAPSHOT_MARKER:
            start, end, _ = UPR_SNAPSHOT_PKT_FMT.unpack(got.extras)
            saved.snapshot[opaque] = (start, end)
        elif cmd == CMD_UPR_NOOP:
            await upr_conn.send(REQ_PKT_FMT.pack(0x81, cmd, 0, 0, 0, 0, 0, opaque, 0))
        elif cmd == CMD_UPR_BUFFER_ACK:
            continue
        else:
            raise AssertionError(f"unexpected UPR message: {cmd}")  # FLUSH included
        batch += cmd in (CMD_UPR_MUTATION, CMD_UPR_DELETE, CMD_UPR_EXPIRATION)
        if batch == BATCH_MAX_SIZE or (batch and not stream_list):  # the batch goes out
            run.acked += batch_bytes - last_processed
            ack = struct.pack(">I", batch_bytes - last_processed)
            await upr_conn.send(send_msg(CMD_UPR_BUFFER_ACK, b"", b"", 0xACC, ack))
            batch, batch_bytes, last_processed = 0, 0, 0
    await upr_conn.aclose()
    for _cmd, vb, *_, seqno in run.msgs:
        saved.seqno[vb] = max(saved.seqno.get(vb, 0), seqno)
    return run


def apply(state: dict[bytes, tuple[int, bytes] | None], run: Run) -> None:
    """What a restore of the runs, in order, leaves."""
    for cmd, _, key, flg, val, _ in run.msgs:
        state[key] = (flg, val) if cmd == CMD_UPR_MUTATION else None


def live(store: Store) -> dict[bytes, tuple[int, bytes] | None]:
    """Every key the node holds: (flags, value), or None once deleted."""
    return {
        it.key: (it.flags, it.value) if it.kind is ItemKind.MUTATION else None
        for vb in range(VBUCKETS)
        for it in store.items_since(vb, 0)
    }


def loaded(items: int) -> Store:
    """Vbuckets 0-2 hold items and a deletion; vbucket 3 is empty (start 0, end 0)."""
    store = Store(VBUCKETS)
    now = time.time()
    for i in range(items):
        store.set(i % 3, b"doc-%05d" % i, b"body-%d" % i, flags=0x2000006 + i, now=now)
    store.delete(1, b"doc-00001", now=now)
    return store


async def high_seqnos(port: int) -> dict[int, int]:
    admin = await RawDcp.connect(port)
    try:
        _, stats = await admin.stats(b"vbucket-seqno")
    finally:
        await admin.aclose()
    return {int(vb): s["high_seqno"] for vb, s in seqno_stats(stats).items()}


async def settle(server: Any, store: Store, side: str) -> None:
    if side == "front":
        with trio.fail_after(20):
            await until(lambda: caught_up(server, store))


async def test_full_backup_then_incremental_gets_every_item_once(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """couchbase-cli 3.0 pump_upr.py ``UPRStreamSource`` against ep-engine
    v3.0.0 src/upr-producer.cc ``UprProducer::streamRequest`` (48-byte
    request, failover log in the answer) and src/upr-stream.cc
    ``ActiveStream`` (a stream whose start is its end only ends): a full
    backup, writes, then a resume from the saved seqno, uuid and snapshot
    brings exactly the new items, and no message the pump has no branch for."""
    store = loaded(900)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    saved = Saved()
    with trio.fail_after(30):
        full = await backup(port, saved)
        assert full.answers == {vb: [0] for vb in range(VBUCKETS)}
        state: dict[bytes, tuple[int, bytes] | None] = {}
        apply(state, full)
        assert state == live(store)
        assert len(full.msgs) == 900 and not [m for m in full.msgs if m[1] == 3]
        assert all(len(saved.failover[vb]) >= 1 for vb in range(VBUCKETS))
        now = time.time()
        for i in range(900, 960):
            store.set(i % 3, b"doc-%05d" % i, b"body-%d" % i, flags=7, now=now)
        store.set(0, b"doc-00003", b"changed", flags=9, now=now)
        store.delete(2, b"doc-00002", now=now)
        await settle(server, store, side)
        incremental = await backup(port, saved)
    assert incremental.answers == {vb: [0] for vb in range(VBUCKETS)}
    assert sorted(m[2] for m in incremental.msgs) == sorted(
        [b"doc-%05d" % i for i in range(900, 960)] + [b"doc-00003", b"doc-00002"]
    )
    apply(state, incremental)
    assert state == live(store)
    assert incremental.opcodes <= {
        CMD_UPR_REQUEST_STREAM, CMD_UPR_SNAPSHOT_MARKER, CMD_UPR_MUTATION,
        CMD_UPR_DELETE, CMD_UPR_END_STREAM,
    }  # fmt: skip
    assert full.acked == full.received and incremental.acked == incremental.received


async def test_stat_vbucket_seqno_names_each_vbucket_as_pump_upr_reads_it(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/ep_engine.cc ``doSeqnoStats`` gives ``vb_N:high_seqno``,
    ``vb_N:uuid`` and ``vb_N:purge_seqno`` and nothing else. couchbase-cli 3.0
    pump_upr.py ``setup_upr_streams`` takes any key holding ``high_seqno`` or
    ``uuid`` for a vbucket's: a later server's ``vb_N:abs_high_seqno`` names a
    vbucket ``N:abs`` and the backup stops on ``int('N:abs')``."""
    _, port = await serve_upr_side(nursery, loaded(30), side, tmp_path)
    with trio.fail_after(20):
        admin = await RawDcp.connect(port)
        status, stats = await admin.stats(b"vbucket-seqno")
        assert status == 0
        assert list(stats) == [
            f"vb_{vb}:{name}" for vb in range(VBUCKETS)
            for name in ("high_seqno", "uuid", "purge_seqno")
        ]  # fmt: skip
        assert sorted(seqno_stats(stats)) == [str(vb) for vb in range(VBUCKETS)]
        status, one = await admin.stats(b"vbucket-seqno 2")
        assert status == 0 and list(one) == ["vb_2:high_seqno", "vb_2:uuid", "vb_2:purge_seqno"]
        await admin.aclose()


async def test_unknown_uuid_rolls_back_to_zero_and_the_retry_streams_everything(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/failover-table.cc ``FailoverTable::needsRollback``:
    a uuid the log does not hold rolls back to 0, a start of 0 never rolls
    back. couchbase-cli 3.0 pump_upr.py ``provide_upr_batch_actual`` unpacks
    the whole ROLLBACK body as ``>Q`` and asks again from there with the same
    uuid and the snapshot (seqno, seqno); it then gets every item."""
    store = loaded(120)
    _, port = await serve_upr_side(nursery, store, side, tmp_path)
    with trio.fail_after(20):
        highs = await high_seqnos(port)
        stranger = Saved(
            seqno=dict(highs),
            failover={vb: [(0xDEADBEEF, 0)] for vb in range(VBUCKETS)},
            snapshot={vb: (h, h) for vb, h in highs.items()},
        )
        run = await backup(port, stranger)
    rolled = {vb for vb, h in highs.items() if h}
    assert {vb for vb, a in run.answers.items() if a == [ERR_ROLLBACK, 0]} == rolled
    state: dict[bytes, tuple[int, bytes] | None] = {}
    apply(state, run)
    assert state == live(store)


async def test_a_resume_past_its_saved_snapshot_is_refused_erange(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """ep-engine v3.0.0 src/upr-producer.cc ``UprProducer::streamRequest``:
    ``snap_start <= start <= snap_end`` or ENGINE_ERANGE. cbbackup's sink
    (pump_bfd.py ``BFD.write_json_file``) keeps a vbucket's first snapshot
    marker of a backup, not its last, so a full backup that saw a DISK then a
    MEMORY snapshot resumes past the snapshot it saved: 3.0.0 refuses, and
    pump_upr.py drops the vbucket from that incremental (its ERANGE branch)."""
    store = loaded(60)
    _, port = await serve_upr_side(nursery, store, side, tmp_path)
    with trio.fail_after(20):
        highs = await high_seqnos(port)
        saved = Saved()
        await backup(port, saved)
        stale = Saved(
            seqno=dict(saved.seqno),
            failover=saved.failover,
            snapshot={vb: (0, highs[vb] - 1) for vb in range(3)},
        )
        run = await backup(port, stale)
    assert run.answers == {0: [ERR_ERANGE], 1: [ERR_ERANGE], 2: [ERR_ERANGE], 3: [0]}
    assert run.msgs == []


# -- testrunner's UprClient (couchbase/testrunner lib/upr_bin_client.py, 2014) -----


def tr_response(got: Reply) -> dict[str, Any]:
    """``StreamRequest.formated_response``: fixed offsets into the body, a
    marker body of exactly 20 bytes whose flag is memory, disk or either with
    the checkpoint bit, and a ROLLBACK body unpacked whole as ``>II``."""
    body = got.extras + got.key + got.value
    if got.opcode == CMD_UPR_REQUEST_STREAM:
        if got.status == 0:
            assert len(body) % 16 == 0
            return {
                "failover_log": [
                    struct.unpack_from(">QQ", body, i) for i in range(0, len(body), 16)
                ]
            }
        assert got.status == ERR_ROLLBACK
        seqno, rollback = struct.unpack(">II", body)
        return {"seqno": seqno, "rollback": rollback}
    if got.opcode == CMD_UPR_END_STREAM:
        return {"flags": struct.unpack(">I", body[0:4])[0]}
    if got.opcode == CMD_UPR_MUTATION:
        by_seqno = struct.unpack(">QQIIIHB", body[0:31])[0]
        return {"by_seqno": by_seqno, "key": body[31 : 31 + len(got.key)]}
    if got.opcode == CMD_UPR_DELETE:
        by_seqno = struct.unpack(">QQH", body[0:18])[0]
        return {"by_seqno": by_seqno, "key": body[18 : 18 + len(got.key)]}
    assert got.opcode == CMD_UPR_SNAPSHOT_MARKER, "(Stream Request) Unknown response"
    assert len(body) == 20
    start, end, flag = struct.unpack(">QQI", body)
    assert flag in (1, 2, 5, 6), f"Invalid snapshot flag: {flag}"
    assert start <= end
    return {"snap": (start, end)}


async def test_testrunner_upr_client_streams_reads_markers_and_rollback(
    nursery: trio.Nursery, side: str, tmp_path: Path
) -> None:
    """couchbase/testrunner lib/upr_bin_client.py ``UprClient.stream_req`` /
    ``UprStream.next_response`` (couchbase/testrunner 48a1958, run against
    both as it is, Python 2.7) on ep-engine 3.0-era src/upr-stream.cc
    ``ActiveStream`` markers (hisundar/ep-engine 8d0998d: MEMORY 0x01 and
    DISK 0x02; the node may add CHECKPOINT 0x04, which the client takes too;
    ACK only in a takeover) and upr-producer.cc ``streamRequest``'s 8-byte
    ROLLBACK body: every vbucket streams to its end, by_seqnos growing, the
    front's memory snapshots included."""
    store = loaded(300)
    server, port = await serve_upr_side(nursery, store, side, tmp_path)
    with trio.fail_after(30):
        upr = await RawDcp.connect(port)
        await upr.send(
            send_msg(CMD_UPR_CONNECT, b"tr-producer", b"", 0x71, struct.pack(">iI", 0, 1))
        )
        assert (await single_response(upr, 0x71)).status == 0
        for i in range(300, 330):  # live writes: the front logs them as memory snapshots
            store.set(0, b"doc-%05d" % i, b"late", flags=0, now=time.time())
        await settle(server, store, side)
        highs = await high_seqnos(port)
        for vb in range(VBUCKETS):
            extras = UPR_STREAM_REQ_PKT_FMT.pack(0, 0, 0, highs[vb], 0, 0, 0)
            await upr.send(send_msg(CMD_UPR_REQUEST_STREAM, b"", b"", 0x100 + vb, extras, vb))
            assert "failover_log" in tr_response(await single_response(upr, 0x100 + vb))
            last = 0
            while (got := await upr.next()) is not None and got.opcode != CMD_UPR_END_STREAM:
                assert got.opaque == 0x100 + vb and got.status == vb
                seen = tr_response(got)
                if "by_seqno" in seen:
                    assert seen["by_seqno"] > last, "Out of order response"
                    last = seen["by_seqno"]
            assert got is not None and tr_response(got) == {"flags": 0}
            assert last == highs[vb]
        extras = UPR_STREAM_REQ_PKT_FMT.pack(
            0, 0, highs[0], 2**64 - 1, 0xDEADBEEF, highs[0], highs[0]
        )
        await upr.send(send_msg(CMD_UPR_REQUEST_STREAM, b"", b"", 0x200, extras, 0))
        assert tr_response(await single_response(upr, 0x200)) == {"seqno": 0, "rollback": 0}
        await upr.aclose()
