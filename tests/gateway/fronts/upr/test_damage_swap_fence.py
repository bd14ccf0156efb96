"""What the TAP connection read before a damaged log was swapped never reaches the new log.

A stream that finds damage sets the log aside, puts a fresh log in its
place and tells the ingest to reconnect (``damage``); the new log is fetched
whole from the TAP node (a backfill from 0 after DEREGISTER_TAP_CLIENT, as
ep-engine 2.5.1 src/tapconnection.cc ``TapProducer::registerCursor`` resumes
a registered client by its cursor otherwise). The old connection may already
hold bytes it read before the cancel reaches it; trio delivers a cancel at
the next checkpoint only, so it applies them first. Here the swap happens
inside the connection's own read, right after the bytes arrived: those items
must go to the retired log (whose writes raise), not to its successor; and
the set-aside rename runs in a worker thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.tap import TapOpcode
from gateway.fronts.upr.damage import set_aside_damaged
from gateway.fronts.upr.ingest import Ingest
from gateway.fronts.upr.segments import LogReadError
from gateway.fronts.upr.vblog import VbLog
from gateway.io.connection import PacketConnection
from tests.gateway.fronts.upr.support import (
    caught_up,
    filled_store,
    final_state,
    open_producer,
    start_front,
    start_node,
    store_state,
    until,
)

DAMAGED = 1


def _mutated_vbucket(data: bytes) -> int | None:
    """The vbucket of the first TAP MUTATION among the whole frames ``data`` starts with."""
    reader = FrameReader()
    try:
        reader.receive_data(data)
        frames = reader.frames()
    except Exception:  # a read that starts inside a frame: not this one
        return None
    for frame in frames:
        if frame.is_request and frame.opcode == TapOpcode.MUTATION:
            return frame.vbucket_or_status
    return None


class Tripwire:
    """The ingest's upstream stream: once armed (``trip``), the first read holding an
    item of ``DAMAGED`` runs ``trip`` (the log set aside, as a stream finding damage
    does) before the read returns, so the connection applies those bytes after it."""

    trip: Callable[[], Awaitable[None]] | None = None

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self._inner.receive_some(max_bytes)
        trip = Tripwire.trip
        if trip is not None and data and _mutated_vbucket(bytes(data)) == DAMAGED:
            Tripwire.trip = None
            await trip()
        return data


async def test_bytes_read_before_the_swap_stay_out_of_the_new_log(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = filled_store(40)
    _, node_port = await start_node(nursery, store, checkpoint_interval=0.05)
    real_connect = PacketConnection.connect

    async def connect(*args: Any, **kwargs: Any) -> PacketConnection:
        client = await real_connect(*args, **kwargs)
        client.stream = Tripwire(client.stream)  # type: ignore[assignment]
        return client

    monkeypatch.setattr(PacketConnection, "connect", connect)
    monkeypatch.setattr(Tripwire, "trip", None)
    front, port, _ = await start_front(nursery, tmp_path, node_port)
    with trio.fail_after(20):
        await until(lambda: caught_up(front, store))

    replaced: list[VbLog] = []
    at_reconnect: list[tuple[int, int]] = []
    real_event = Ingest.connect_event

    def connect_event(ingest: Ingest, logs: list[VbLog]) -> Any:
        if replaced and not at_reconnect:
            new = replaced[0]
            at_reconnect.append((new.items_total, new.high_seqno))
        return real_event(ingest, logs)

    monkeypatch.setattr(Ingest, "connect_event", connect_event)

    async def trip() -> None:
        damaged = front.logs.logs[DAMAGED]
        await set_aside_damaged(front, damaged, LogReadError("damaged (test)"))
        new = front.logs.logs[DAMAGED]
        assert new is not damaged
        replaced.append(new)
        at_swap.append((new.items_total, new.high_seqno))

    at_swap: list[tuple[int, int]] = []
    # The set-aside rename runs in a worker thread, not on the trio loop.
    renamed_on: list[bool] = []
    real_rename = os.rename
    damaged_dir = front.logs.logs[DAMAGED].dir

    def rename(src: Any, dst: Any) -> None:
        if Path(src) == damaged_dir:
            renamed_on.append(threading.current_thread() is threading.main_thread())
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    Tripwire.trip = trip
    with trio.fail_after(20):
        n = 0
        while not replaced:  # live writes, each in a TAP read of its own
            key = b"live-%d" % n
            store.set(DAMAGED, key, b"v%d" % n, now=time.time())
            n += 1
            await until(
                lambda key=key: bool(replaced) or key in front.logs.logs[DAMAGED].translator.index
            )
        await until(lambda: bool(at_reconnect))
    # Nothing of the old connection reached the new log before the new one connected.
    assert at_reconnect == at_swap
    assert renamed_on == [False]
    with trio.fail_after(30):
        await until(lambda: caught_up(front, store))
    client = await open_producer(port, b"after")
    try:
        new = front.logs.logs[DAMAGED]
        reply = await client.stream_request(DAMAGED, 0, new.high_seqno, opaque=7)
        assert isinstance(reply, upr.StreamRequestOk), reply
        with trio.fail_after(20):
            log = await client.read_stream(7)
    finally:
        await client.aclose()
    assert final_state(log) == store_state(store, DAMAGED)
