"""Gateway restarts and upstream resets: nothing acked is lost, seqnos never reused."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from adapters import upr
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.fronts.upr.vblog import RESERVE_STEP, VbLog
from gateway.metrics.figures import GatewayStats
from gateway.node.store import Store
from tests.gateway.fronts.upr.support import (
    MAX_SEQNO,
    VBUCKETS,
    caught_up,
    filled_store,
    final_state,
    open_producer,
    start_front,
    start_node,
    store_state,
    until,
    write_load,
)
from tests.support.children import start_listening
from tests.support.fronts import upr_front_over_node
from tests.support.raw_dcp import RawDcp
from tests.support.upr_client import StreamLog, check_snapshots


async def read_all(
    port: int, positions: dict[int, tuple[int, int]], name: bytes
) -> dict[int, StreamLog]:
    """Stream every vbucket from ``positions`` (vb -> (uuid, seqno)) to the current high."""
    admin = await RawDcp.connect(port)
    status, seqnos = await admin.stats(b"vbucket-seqno")
    await admin.aclose()
    assert status == 0
    client = await open_producer(port, name)
    out = {}
    for vb in range(VBUCKETS):
        uuid, start = positions.get(vb, (0, 0))
        high = int(seqnos[f"vb_{vb}:high_seqno"])
        reply = await client.stream_request(vb, start, high, uuid=uuid, opaque=vb + 1)
        assert isinstance(reply, upr.StreamRequestOk), reply
        out[vb] = await client.read_stream(vb + 1)
    await client.aclose()
    return out


async def test_killed_gateway_resumes_without_loss_or_reused_seqnos(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(
        nursery, tmp_path, store, node={"checkpoint_interval": 0.05}, close_logs=False
    )
    await write_load(store, 200, seed=3)
    await rig.catch_up()
    # A consumer holds everything so far.
    before = {}
    client = await rig.consumer(b"keeper")
    for vb in range(VBUCKETS):
        high = rig.front.logs.logs[vb].high_seqno
        await client.stream_request(vb, 0, high, opaque=vb + 1)
        before[vb] = await client.read_stream(vb + 1)
    await client.aclose()
    positions = {
        vb: (rig.front.logs.logs[vb].failover.uuid, log.items[-1].by_seqno)
        for vb, log in before.items()
    }
    await rig.running.stop()  # no clean close: as if killed
    await write_load(store, 200, seed=4)
    front2, port2, scope2 = await start_front(nursery, tmp_path, rig.node_port)
    with trio.fail_after(10):
        await until(lambda: caught_up(front2, store))
    after = await read_all(port2, positions, b"keeper")
    for vb in range(VBUCKETS):
        # Killed: a new failover entry at the proven end, past which the consumer saw nothing.
        assert not front2.logs.logs[vb].continued
        old_seqnos = {e.by_seqno for e in before[vb].items}
        assert all(e.by_seqno > positions[vb][1] for e in after[vb].items)
        merged = StreamLog(before[vb].events + after[vb].events)
        assert final_state(merged) == store_state(store, vb)
        assert not old_seqnos & {e.by_seqno for e in after[vb].items}
    scope2.cancel()


async def test_torn_tail_starts_a_new_history_past_every_used_seqno(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store, close_logs=False)
    await rig.catch_up()
    old = {vb: (v.failover.uuid, v.high_seqno, v.reserved) for vb, v in rig.front.logs.logs.items()}
    await rig.running.stop()
    segment = rig.front.logs.logs[0].segments[-1].path
    with open(segment, "ab") as f:
        f.write(b"\x00\x00\x01\x00garbage")  # half a record, as a crash mid-write leaves
    now = time.time()
    store.set(0, b"after-crash", b"x", now=now)
    front2, port2, scope2 = await start_front(nursery, tmp_path, rig.node_port)
    with trio.fail_after(10):
        await until(lambda: caught_up(front2, store))
    vblog = front2.logs.logs[0]
    uuid, high, reserved = old[0]
    assert not vblog.continued and vblog.torn_bytes == 11
    # The new entry starts at the proven end, new seqnos past every one reserved.
    assert vblog.failover.entries[1][0] == uuid and vblog.failover.entries[0][1] == high
    assert vblog.translator.version(b"after-crash").seqno > reserved
    # A consumer of the old history resumes without rollback (nothing it saw is gone).
    client = await open_producer(port2)
    reply = await client.stream_request(0, high, MAX_SEQNO, uuid=uuid, opaque=1)
    assert isinstance(reply, upr.StreamRequestOk), reply
    await client.aclose()
    # The other vbuckets (proven whole, not closed cleanly) too: their consumers resume.
    assert front2.logs.logs[1].failover.entries[1] == (old[1][0], 0)
    scope2.cancel()


async def test_node_restarted_without_data_is_reconciled(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    client = await rig.consumer(b"steady")
    positions = {}
    logs = {}
    for vb in range(VBUCKETS):
        v = rig.front.logs.logs[vb]
        positions[vb] = (v.failover.uuid, v.high_seqno)
        await client.stream_request(vb, 0, v.high_seqno, opaque=vb + 1)
        logs[vb] = await client.read_stream(vb + 1)
    await client.aclose()
    await rig.running.stop()  # its logs closed cleanly before the next gateway opens them
    # A new node: some keys as they were (same versions), some changed, most gone.
    fresh = Store(VBUCKETS)
    now = time.time()
    kept = {}
    for vb in range(VBUCKETS):
        for item in store.items_since(vb, 0)[:5]:
            if not item.deleted:
                fresh.apply_mutation(
                    vb,
                    item.key,
                    item.value,
                    flags=item.flags,
                    expiration=item.expiration,
                    cas=item.cas,
                    rev_seqno=item.rev_seqno,
                    now=now,
                )
                kept[(vb, item.key)] = item.cas
        fresh.set(vb, b"brand-new", b"n", now=now)
        fresh.set(vb, b"key-1", b"changed", now=now)
    rig = await upr_front_over_node(nursery, tmp_path, fresh)
    with trio.fail_after(10):
        await until(lambda: caught_up(rig.front, fresh, live_only=True))
    after = await read_all(rig.port, positions, b"steady")
    for vb in range(VBUCKETS):
        assert rig.front.logs.logs[vb].failover.uuid == positions[vb][0]  # no rollback needed
        merged = StreamLog(logs[vb].events + after[vb].events)
        want = {k: v for k, v in store_state(fresh, vb).items() if v[1] is not None}
        got = {k: v for k, v in final_state(merged).items() if v[1] is not None}
        assert got == want
        check_snapshots(after[vb])
        for (kvb, key), cas in kept.items():
            if kvb == vb and key != b"key-1":
                # Unchanged: kept its seqno, so it is not sent again.
                assert key not in {e.key for e in after[vb].items}
                assert final_state(merged)[key][0] == cas
    rig.running.cancel()


GATEWAY = """
import sys, trio
from pathlib import Path
from gateway.fronts.upr import UprFrontConfig, serve_upr_front

async def main():
    config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", int(sys.argv[1])), Path(sys.argv[2]),
                            compact_interval=0, reconnect_min=0.02, reconnect_max=0.2)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_upr_front, config)
        print(port, flush=True)

trio.run(main)
"""


async def test_sigkilled_gateway_process_loses_nothing_acked(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    node, node_port = await start_node(nursery, store, checkpoint_interval=0.05)
    proc, port = await start_listening(GATEWAY, node_port, tmp_path, what="the gateway")
    assert port > 0  # listening: the ingest is running

    def acked() -> bool:
        registration = node.tap.registration("upr-front")
        if registration is None:
            return False
        return all(
            vb in registration.positions
            and registration.positions[vb].seqno >= store.high_seqno(vb)
            for vb in range(VBUCKETS)
        )

    load = trio.CancelScope()

    async def keep_writing() -> None:
        with load:
            await write_load(store, 10_000, seed=9, pause_every=10)

    def acked_live_writes() -> bool:
        registration = node.tap.registration("upr-front")
        return registration is not None and any(
            position.seqno > filled[vb] for vb, position in registration.positions.items()
        )

    filled = {vb: store.high_seqno(vb) for vb in range(VBUCKETS)}
    nursery.start_soon(keep_writing)
    with trio.fail_after(20):
        await until(acked_live_writes)
    proc.send_signal(signal.SIGKILL)  # mid-stream, while writes go on
    await proc.wait()
    load.cancel()
    # Every version the node saw acknowledged (and still holds) is in the log.
    registration = node.tap.registration("upr-front")
    assert registration is not None
    logs = LogSet(tmp_path, LogOptions(), GatewayStats())
    logs.open_existing()
    checked = 0
    for vb, position in registration.positions.items():
        translator = logs.logs[vb].translator
        for item in store.items_since(vb, 0, position.seqno):
            version = translator.version(item.key)
            assert version is not None and version.cas == item.cas, (vb, item)
            checked += 1
    logs.abandon()
    assert checked
    front, port2, scope = await start_front(nursery, tmp_path, node_port)
    with trio.fail_after(20):
        await until(lambda: caught_up(front, store))
    with trio.fail_after(10):
        await until(acked)
    for vb in range(VBUCKETS):
        items = front.logs.logs[vb].read(0, MAX_SEQNO, 1_000_000)
        seqnos = [i.by_seqno for i in items]
        assert seqnos == sorted(set(seqnos))
    log = await read_all(port2, {}, b"after-kill")
    for vb in range(VBUCKETS):
        assert final_state(log[vb]) == store_state(store, vb)
    scope.cancel()


async def test_a_crash_after_serving_unsynced_items_rolls_the_consumer_back_to_the_proven_end(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fsync batch serves items before their fsync returns. The gateway dies with an
    fsync held, and the disk keeps only what was synced (the file cut back to it, as
    a power loss leaves it). On restart the log opens with a new failover entry at its
    proven end, as ep-engine 3.0's warmup after an unclean shutdown (src/warmup.cc,
    ``Warmup::createVBuckets``); the consumer that saw the lost items gets ROLLBACK to
    that end by 3.0's rule (src/failover-table.cc, ``FailoverTable::needsRollback``),
    and after it converges with the node, which sends again what was never acked."""
    store = filled_store(10)
    rig = await upr_front_over_node(
        nursery,
        tmp_path,
        store,
        node={"checkpoint_interval": 0.05},
        fsync="batch",
        close_logs=False,
    )
    await rig.catch_up(20)
    vblog = rig.front.logs.logs[0]
    with trio.fail_after(20):  # every commit so far has returned: all synced
        await until(lambda: vblog.syncing == 0 and not vblog.unsynced)
    synced = vblog.segments[-1].size
    old_uuid, proven = vblog.failover.uuid, vblog.high_seqno
    release, waiting = threading.Event(), threading.Event()

    def held_sync(log: VbLog) -> None:  # in a worker thread: the fsync never completes
        waiting.set()
        release.wait(20)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(VbLog, "sync", held_sync)
    for n in range(5):
        store.set(0, b"lost-%d" % n, b"v", now=time.time())
    client = await rig.consumer(b"early")
    with trio.fail_after(20):
        await until(lambda: vblog.high_seqno >= proven + 5)
    seen = vblog.high_seqno
    await client.stream_request(0, 0, seen, opaque=1)
    before = await client.read_stream(1)
    assert {b"lost-%d" % n for n in range(5)} <= {e.key for e in before.items}
    await client.aclose()
    with trio.fail_after(20):  # their commit waits for its fsync
        await trio.to_thread.run_sync(waiting.wait, abandon_on_cancel=True)
    # Power loss: the page cache's unsynced bytes never reach the disk.
    os.truncate(vblog.segments[-1].path, synced)
    stopping = trio.Event()

    async def stop() -> None:
        await rig.running.stop()
        stopping.set()

    nursery.start_soon(stop)
    await trio.testing.wait_all_tasks_blocked()
    release.set()  # the held thread returns into a cancelled commit: nothing acked
    with trio.fail_after(20):
        await stopping.wait()
    monkeypatch.undo()

    front2, port2, scope2 = await start_front(nursery, tmp_path, rig.node_port)
    again = front2.logs.logs[0]
    assert not again.continued
    assert again.failover.entries[0][1] == proven and again.failover.entries[1][0] == old_uuid
    client = await open_producer(port2, b"early")
    reply = await client.stream_request(
        0, seen, MAX_SEQNO, uuid=old_uuid, snap=(seen, seen), opaque=1
    )
    assert isinstance(reply, upr.StreamRequestRollback) and reply.rollback_seqno == proven
    with trio.fail_after(20):
        await until(lambda: caught_up(front2, store))
    kept = [e for e in before.events if not hasattr(e, "by_seqno") or e.by_seqno <= proven]
    reply = await client.stream_request(0, proven, again.high_seqno, uuid=old_uuid, opaque=2)
    assert isinstance(reply, upr.StreamRequestOk), reply
    after = await client.read_stream(2)
    await client.aclose()
    assert all(e.by_seqno > again.reserved - RESERVE_STEP for e in after.items)
    assert final_state(StreamLog(kept + after.events)) == store_state(store, 0)
    scope2.cancel()
