"""Direct TAP capture: record everything a TAP producer sends, untranslated.

Theory of operation. After ``session.prepare`` the connection sends one
CONNECT: backfill from date 0 (everything), list of the active vbuckets,
support ack, fixed flag byte order. Each message is recorded as it comes:
MUTATION and DELETE as items (TAP cannot tell an expiry from a delete, so
deletes are ``Kind.DELETE``; there are no seqnos, ``by_seqno`` is None), with
the id of the checkpoint they came in (None during backfill);
CHECKPOINT_START/END and OPAQUE(initial vbucket stream / close backfill) as
boundaries. Every message that asks for an ack is acked at once (an ack
covers all earlier messages), NOOPs are answered.

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
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapConnect,
    TapDelete,
    TapFlags,
    TapFlush,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapOpcode,
    TapResponse,
    TapVbucketSet,
    decode_frame,
    encode,
)
from gateway.capture.recorder import CaptureRecorder
from gateway.capture.records import Kind
from gateway.capture.session import (
    CaptureFailed,
    CaptureOptions,
    CaptureResult,
    new_recorder,
    prepare,
)
from gateway.client import McbpClient
from gateway.wire import PacketConnection

log = logging.getLogger(__name__)

CONNECT_FLAGS = (
    ConnectFlags.BACKFILL
    | ConnectFlags.LIST_VBUCKETS
    | ConnectFlags.SUPPORT_ACK
    | ConnectFlags.FIX_FLAG_BYTEORDER
)
OPCODES = {
    TapMutation: TapOpcode.MUTATION,
    TapDelete: TapOpcode.DELETE,
    TapFlush: TapOpcode.FLUSH,
    TapOpaque: TapOpcode.OPAQUE,
    TapCheckpointStart: TapOpcode.CHECKPOINT_START,
    TapCheckpointEnd: TapOpcode.CHECKPOINT_END,
    TapVbucketSet: TapOpcode.VBUCKET_SET,
}
FLUSH_SECONDS = 2.0


def swap32(flags: int) -> int:
    return int.from_bytes(flags.to_bytes(4, "big"), "little")


async def capture_tap(
    options: CaptureOptions,
    *,
    task_status: trio.TaskStatus[CaptureResult] = trio.TASK_STATUS_IGNORED,
) -> CaptureResult:
    """Capture until caught up (with ``until_caught_up``), the server closes, or cancelled.

    Cancelled, it returns nothing but still closes the segment cleanly; the
    ``CaptureResult`` handed to ``task_status.started`` is complete by then.
    """
    client = await McbpClient.connect(options.host, options.port, name="capture")
    try:
        vbuckets, high = await prepare(client, options)
        name = options.connection_name("tap")
        result = CaptureResult("tap", name, vbuckets, high)
        recorder = new_recorder(options, "tap", name)
        conn = PacketConnection(client.stream, name=f"tap {options.host}:{options.port}")
        conn.reader = client.reader  # keeps anything already read past the STAT replies
        async with trio.open_nursery() as nursery:
            await nursery.start(recorder.run)
            nursery.start_soon(conn.run_writer)
            try:
                connect = TapConnect(
                    name.encode(), CONNECT_FLAGS, backfill_date=0, vbuckets=tuple(vbuckets)
                )
                conn.send_nowait(encode(connect))
                task_status.started(result)
                await _consume(conn, recorder, result, options.until_caught_up)
            finally:
                with trio.CancelScope(shield=True):
                    conn.finish()  # the last acks go out before the socket closes
                    with trio.move_on_after(FLUSH_SECONDS):
                        await conn.writer_done.wait()
                    await recorder.close()
                    result.finish(recorder)
                nursery.cancel_scope.cancel()
        return result
    finally:
        await client.aclose()


async def _consume(
    conn: PacketConnection, recorder: CaptureRecorder, result: CaptureResult, until: bool
) -> None:
    checkpoint: dict[int, int | None] = {}
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
        if isinstance(event, TapMutation):
            flags = event.flags
            if not event.tap_flags & TapFlags.NETWORK_BYTE_ORDER:
                flags = swap32(flags)
            value = None if event.tap_flags & TapFlags.NO_VALUE else event.value
            recorder.record_item(
                event.vbucket,
                event.key,
                Kind.MUTATION,
                by_seqno=None,
                rev_seqno=event.rev_seqno,
                cas=event.cas,
                flags=flags,
                expiration=event.expiration,
                value=value,
                checkpoint_id=checkpoint.get(event.vbucket),
                arrival=now,
            )
            result.count(Kind.MUTATION)
        elif isinstance(event, TapDelete):
            recorder.record_item(
                event.vbucket,
                event.key,
                Kind.DELETE,
                by_seqno=None,
                rev_seqno=event.rev_seqno,
                cas=event.cas,
                checkpoint_id=checkpoint.get(event.vbucket),
                arrival=now,
            )
            result.count(Kind.DELETE)
        elif isinstance(event, TapCheckpointStart | TapCheckpointEnd):
            start = isinstance(event, TapCheckpointStart)
            kind = Kind.CHECKPOINT_START if start else Kind.CHECKPOINT_END
            checkpoint[event.vbucket] = event.checkpoint_id if start else None
            recorder.record_marker(
                event.vbucket, kind, checkpoint_id=event.checkpoint_id, arrival=now
            )
            result.count(kind)
        elif isinstance(event, TapOpaque) and event.opaque_code in (
            OpaqueCode.INITIAL_VBUCKET_STREAM,
            OpaqueCode.CLOSE_BACKFILL,
        ):
            begins = event.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM
            kind = Kind.BACKFILL_START if begins else Kind.BACKFILL_END
            recorder.record_marker(event.vbucket, kind, arrival=now)
            result.count(kind)
            if not begins:
                pending.discard(event.vbucket)
                result.caught_up.add(event.vbucket)
        elif isinstance(event, TapFlush):
            log.warning("%s: the server flushed vbucket %d", conn.name, event.vbucket)
        if not isinstance(event, TapConnect | TapNoopResponse) and event.tap_flags & TapFlags.ACK:
            conn.send_nowait(encode(TapResponse(OPCODES[type(event)], event.opaque)))
        if until and not pending:
            result.stopped = "caught-up"
            return
