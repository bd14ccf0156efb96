"""A scripted TAP node for the UPR front's takeover tests, and fsyncs a test holds.

The UPR front opens two kinds of TAP connection to its node (ep-engine
2.5.1 src/tapconnection.cc, ``TapProducer``): its own ingest, which streams
every vbucket, and for each takeover stream a connection with the
TAKEOVER_VBUCKETS flag, over which the node hands the vbucket over with
VBUCKET_SET(pending), the stream, VBUCKET_SET(active), each acked. A test
gives ``start_front_with_node`` one script for each kind of connection;
``ask_state`` is the node's side of one VBUCKET_SET.
"""

from __future__ import annotations

import errno
import struct
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters.mcbp import Frame, FrameReader
from adapters.mcbp.constants import VBucketState
from adapters.tap import TapFlags, TapVbucketSet, encode
from gateway.fronts.upr.server import UprFront
from gateway.fronts.upr.vblog import VbLog
from tests.gateway.fronts.upr.support import start_front

TAKEOVER_VBUCKETS = 0x08
"""TAP CONNECT flag of a takeover connection (ep-engine 2.5.1
``TAP_CONNECT_FLAG_TAKEOVER_VBUCKETS``)."""

Script = Callable[[trio.SocketStream, FrameReader], Awaitable[None]]
"""What the node does on one connection once it read the CONNECT."""


async def read_frame(stream: trio.SocketStream, reader: FrameReader) -> Frame:
    """The next frame the gateway sent (AssertionError once it closed)."""
    while (frame := reader.next_frame()) is None:
        data = await stream.receive_some(65536)
        assert data, "the gateway closed the TAP connection"
        reader.receive_data(data)
    return frame


async def ask_state(
    stream: trio.SocketStream, reader: FrameReader, vb: int, state: VBucketState, opaque: int
) -> int | None:
    """VBUCKET_SET(``state``) with the ACK flag: the status of the gateway's ack, or None
    when it closed the connection without acking."""
    await stream.send_all(encode(TapVbucketSet(state, vb, opaque=opaque, tap_flags=TapFlags.ACK)))
    try:
        while True:
            frame = await read_frame(stream, reader)
            if not frame.is_request and frame.opaque == opaque:
                return frame.vbucket_or_status
    except (AssertionError, trio.BrokenResourceError):
        return None


def tap_node(own: Script, takeover: Script) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A ``serve_tcp`` handler: ``own`` for the ingest's connection, ``takeover`` for a
    takeover connection."""

    async def serve(stream: trio.SocketStream) -> None:
        reader = FrameReader()
        connect = await read_frame(stream, reader)
        (flags,) = struct.unpack_from(">I", connect.extras)
        await (takeover if flags & TAKEOVER_VBUCKETS else own)(stream, reader)

    return serve


async def start_front_with_node(
    nursery: trio.Nursery, tmp_path: Path, own: Script, takeover: Script, **options: Any
) -> tuple[UprFront, int]:
    """The scripted node listening on loopback, and the UPR front ingesting from it (its
    port); ``options`` go to the front's config."""
    serve = tap_node(own, takeover)
    listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    node_port = listeners[0].socket.getsockname()[1]
    front, port, _ = await start_front(nursery, tmp_path, node_port, **options)
    return front, port


class HeldSyncs:
    """``VbLog.sync`` (of ``vbucket``, or of every log) blocks in its worker thread while
    ``hold`` is set, until ``release``, counting the waits; fails with EIO once ``fail``
    is set. Only a log with unsynced records is held or failed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, vbucket: int | None = None) -> None:
        self.hold = threading.Event()
        self.release = threading.Event()
        self.fail = threading.Event()
        self.waiting = 0
        self._lock = threading.Lock()
        real = VbLog.sync

        def sync(vblog: VbLog) -> None:
            if (vbucket is not None and vblog.vbucket != vbucket) or not vblog.unsynced:
                real(vblog)
                return
            if self.fail.is_set():
                raise OSError(errno.EIO, "Input/output error (injected)")
            if self.hold.is_set():
                with self._lock:
                    self.waiting += 1
                self.release.wait()
            real(vblog)

        monkeypatch.setattr(VbLog, "sync", sync)
