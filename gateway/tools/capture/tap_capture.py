"""Direct TAP capture: record everything a TAP producer sends, untranslated.

Theory of operation. After ``session.prepare`` the connection sends one
CONNECT: backfill from date 0 (everything), list of the active vbuckets,
support ack, fixed flag byte order, checkpoints (a 2.x producer, and the TAP
front, send CHECKPOINT_START/END only to a client with that flag). Each
message is recorded as it comes: MUTATION and DELETE as items (TAP cannot
tell an expiry from a delete, so deletes are ``Kind.DELETE``; there are no
seqnos, ``by_seqno`` is None), with the id of the checkpoint they came in
(None during backfill); CHECKPOINT_START/END and OPAQUE(initial vbucket
stream / close backfill) as boundaries. Every message that asks for an ack
is acked at once (an ack covers all earlier messages), NOOPs are answered.

``until_caught_up``: a 2.x backfill reads each vbucket up to its high seqno
when the backfill starts, which is after the STAT taken at start, so the
capture stops once every vbucket sent OPAQUE(close backfill).
"""

from __future__ import annotations

import logging
import time

import trio

from adapters.errors import ProtocolError
from adapters.tap import (
    ConnectFlags,
    TapConnect,
    TapFlags,
    TapFlush,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapResponse,
    decode_frame,
    encode,
)
from adapters.tap.acks import ack_of
from gateway.io.connection import PacketConnection
from gateway.tools.capture.mapping import TapRecording
from gateway.tools.capture.recorder import CaptureRecorder
from gateway.tools.capture.records import Kind
from gateway.tools.capture.session import (
    CaptureFailed,
    CaptureOptions,
    CaptureResult,
    dialed,
    new_recorder,
    prepare,
    record,
)

log = logging.getLogger(__name__)

CONNECT_FLAGS = (
    ConnectFlags.BACKFILL
    | ConnectFlags.LIST_VBUCKETS
    | ConnectFlags.SUPPORT_ACK
    | ConnectFlags.FIX_FLAG_BYTEORDER
    # The checkpoint boundaries are part of what is verified (2.5.1 tapconnection.cc
    # ``supportCheckpointSync_``: none without this flag).
    | ConnectFlags.CHECKPOINT
)


async def capture_tap(
    options: CaptureOptions,
    *,
    task_status: trio.TaskStatus[CaptureResult] = trio.TASK_STATUS_IGNORED,
) -> CaptureResult:
    """Capture until caught up (with ``until_caught_up``), the server closes, or cancelled.

    Cancelled, it returns nothing but still closes the segment cleanly; the
    ``CaptureResult`` handed to ``task_status.started`` is complete by then.
    """
    async with dialed(options, "tap") as conn:
        vbuckets, high = await prepare(conn, options)
        name = options.connection_name("tap")
        result = CaptureResult("tap", name, vbuckets, high)
        recorder = new_recorder(options, "tap", name)
        # The command connection becomes the stream, keeping what it read.
        connect = TapConnect(
            name.encode(), CONNECT_FLAGS, backfill_date=0, vbuckets=tuple(vbuckets)
        )
        await record(
            conn,
            recorder,
            result,
            task_status,
            start=lambda: conn.send_nowait(encode(connect)),
            consume=lambda: _consume(conn, recorder, result, options.until_caught_up),
        )
        return result


async def _consume(
    conn: PacketConnection, recorder: CaptureRecorder, result: CaptureResult, until: bool
) -> None:
    recording = TapRecording(recorder)
    pending = set(result.vbuckets)
    if until and not pending:
        result.stopped = "caught-up"
        return
    while True:
        frame = await conn.receive_frame()
        if frame is None:
            result.stopped = "server-closed"
            if until and pending:
                raise CaptureFailed(
                    f"the server closed the TAP stream before {len(pending)} vbuckets "
                    f"finished their backfill: {sorted(pending)[:10]}"
                )
            return
        try:
            event = decode_frame(frame)
        except ProtocolError as exc:
            raise CaptureFailed(f"the server sent a malformed TAP message: {exc}") from None
        now = time.time()
        if isinstance(event, TapNoop):
            conn.send_nowait(encode(TapNoopResponse(event.opaque)))
            continue
        if isinstance(event, TapResponse):
            if event.status:
                text = event.text.decode("utf-8", "replace")
                raise CaptureFailed(
                    f"the server refused the TAP {event.opcode.name} "
                    f"(status 0x{event.status:02x}): {text}"
                )
            continue
        kind = recording.record(event, now)
        if kind is not None:
            result.count(kind)
            if kind is Kind.BACKFILL_END and isinstance(event, TapOpaque):
                pending.discard(event.vbucket)
                result.caught_up.add(event.vbucket)
        if isinstance(event, TapFlush):
            log.warning("%s: the server flushed vbucket %d", conn.name, event.vbucket)
        if not isinstance(event, TapConnect | TapNoopResponse) and event.tap_flags & TapFlags.ACK:
            conn.send_nowait(ack_of(event))
        if until and not pending:
            result.stopped = "caught-up"
            return
