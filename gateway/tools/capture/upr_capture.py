"""Direct UPR capture: record every stream of a UPR producer, untranslated.

Theory of operation. After ``session.prepare`` the connection (released
dialect) OPENs a producer, asks for the expiry opcode (so expirations and
deletions can be told apart; a server that refuses it leaves deletes
recorded as ``Kind.DELETE``), announces ``connection_buffer_size`` and then
sends one STREAM_REQ per vbucket from seqno 0, all at once. The draft dialect
has neither OPEN nor CONTROL: it goes straight to the stream requests.

Every message is recorded as it comes: items with their by_seqno and the
range of the snapshot they came in, markers (snapshot, draft snapshot
start/end, stream end) as boundaries. Flow control follows
``ConsumerAcker``: every counted message's wire size is acknowledged once
20% of the buffer has been processed, or after a few seconds. NOOPs,
snapshot markers with the ACK flag and SET_VBUCKET_STATE are answered.

``until_caught_up``: each stream is requested up to the vbucket's high
seqno seen at start, so the producer ends it there (STREAM_END); the
capture stops when every stream has ended. Otherwise streams run to the
end of seqnos and the capture runs until cancelled or the server closes.
"""

from __future__ import annotations

import logging
import time

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp.constants import Status, status_name
from adapters.upr.consumer_handshake import ConsumerHandshake, HandshakeRefused
from adapters.upr.flow_control import ConsumerAcker, counts
from gateway.io.connection import PacketConnection
from gateway.tools.capture.mapping import UprRecording
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

MAX_SEQNO = 0xFFFFFFFFFFFFFFFF
OPAQUE_BASE = 0x10000
"""Stream ``vb`` uses opaque OPAQUE_BASE + vb; set-up requests use smaller ones."""
_OK = Status.SUCCESS.value


def _refused(what: str, response: upr.UprResponse) -> CaptureFailed:
    status = getattr(response, "status", 0)
    text = getattr(response, "value", b"").decode("utf-8", "replace")
    return CaptureFailed(
        f"{what} refused: {status_name(status)} (0x{status:02x})" + (f": {text}" if text else "")
    )


async def _set_up(
    client: PacketConnection, options: CaptureOptions, dialect: upr.Dialect, name: str
) -> bool:
    """OPEN and CONTROLs (``ConsumerHandshake``); whether expirations will come as
    EXPIRATION."""
    # A server with the expiry opcode grants it only on a connection opened with
    # include-delete-times (0x20); 3.0 servers look at the producer bit alone.
    handshake = ConsumerHandshake(
        dialect,
        name.encode(),
        flags=upr.OpenFlags.PRODUCER | upr.OpenFlags.INCLUDE_DELETE_TIMES,
        expiry_opcode=True,
        buffer_size=options.buffer_size,
    )
    try:
        while (request := handshake.next_request()) is not None:
            await client.send(request)
            while not handshake.receive(upr.decode_frame(await client.next_frame(), dialect)):
                pass  # nothing else flows before the answer
    except HandshakeRefused as exc:
        raise CaptureFailed(str(exc)) from None
    expiry_opcode = handshake.granted.get("CONTROL enable_expiry_opcode", False)
    if not expiry_opcode:
        log.info("%s: the server has no expiry opcode; deletes stay unclassified", name)
    return expiry_opcode


async def capture_upr(
    options: CaptureOptions,
    *,
    task_status: trio.TaskStatus[CaptureResult] = trio.TASK_STATUS_IGNORED,
) -> CaptureResult:
    """Capture until caught up (with ``until_caught_up``), the server closes, or cancelled."""
    dialect = upr.get_dialect(options.dialect)
    draft = upr.Command.SNAPSHOT_MARKER not in dialect.opcodes
    async with dialed(options, "upr") as conn:
        vbuckets, high = await prepare(conn, options)
        name = options.connection_name("upr")
        try:
            expiry_opcode = False if draft else await _set_up(conn, options, dialect, name)
        except ProtocolError as exc:
            raise CaptureFailed(f"the server sent a malformed UPR response: {exc}") from None
        result = CaptureResult("upr", name, vbuckets, high)
        recorder = new_recorder(options, "upr", name)
        # The command connection becomes the stream, keeping what it read.
        stream = _Streams(conn, recorder, result, dialect, options, expiry_opcode)
        await record(
            conn, recorder, result, task_status, start=stream.request_all, consume=stream.consume
        )
        return result


class _Streams:
    """The streams of one capture connection (see the module docstring)."""

    def __init__(
        self,
        conn: PacketConnection,
        recorder: CaptureRecorder,
        result: CaptureResult,
        dialect: upr.Dialect,
        options: CaptureOptions,
        expiry_opcode: bool,
    ) -> None:
        self.conn = conn
        self.recorder = recorder
        self.result = result
        self.dialect = dialect
        self.until = options.until_caught_up
        self.draft = upr.Command.SNAPSHOT_MARKER not in dialect.opcodes
        self.recording = UprRecording(
            recorder, delete_kind=Kind.DELETION if expiry_opcode else Kind.DELETE
        )
        self.acker = (
            None if self.draft else ConsumerAcker(options.buffer_size, now=trio.current_time())
        )
        self.open: set[int] = set()
        """Vbuckets whose stream has not ended."""

    def send(self, event: upr.UprEvent) -> None:
        self.conn.send_nowait(upr.encode(event, self.dialect))

    def request_all(self) -> None:
        for vb in self.result.vbuckets:
            high = self.result.start_high_seqnos[vb]
            if self.until and high == 0:
                self.result.caught_up.add(vb)  # nothing to read up to
                continue
            self.send(
                upr.StreamRequest(
                    start_seqno=0,
                    end_seqno=high if self.until else MAX_SEQNO,
                    opaque=OPAQUE_BASE + vb,
                    vbucket=vb,
                )
            )
            self.open.add(vb)

    async def consume(self) -> None:
        if not self.open:
            self.result.stopped = "caught-up" if self.until else "no-streams"
            return
        while self.open:
            frame = None
            with trio.move_on_after(self.acker.seconds if self.acker else 3600):
                frame = await self.conn.receive_frame()
                if frame is None:
                    self.result.stopped = "server-closed"
                    if self.until:
                        raise CaptureFailed(
                            f"the server closed the connection before {len(self.open)} "
                            f"streams caught up: {sorted(self.open)[:10]}"
                        )
                    return
            now = trio.current_time()
            if self.acker is not None:
                due = self.acker.due(now)
                if due:
                    self.send(upr.BufferAcknowledgement(due))
            if frame is None:
                continue
            try:
                event = upr.decode_frame(frame, self.dialect)
            except ProtocolError as exc:
                raise CaptureFailed(f"the server sent a malformed UPR message: {exc}") from None
            self.on_event(event, time.time())
            if self.acker is not None and counts(event):
                freed = self.acker.processed(frame.size, now)
                if freed:
                    self.send(upr.BufferAcknowledgement(freed))
        self.result.stopped = "caught-up" if self.until else "streams-ended"

    def vbucket_of(self, event: upr.UprEvent) -> int:
        opaque = event.opaque
        if OPAQUE_BASE <= opaque < OPAQUE_BASE + 0x10000:
            return opaque - OPAQUE_BASE
        return getattr(event, "vbucket", 0)

    def on_event(self, event: upr.UprEvent, arrival: float) -> None:
        result = self.result
        vb = self.vbucket_of(event)
        kind = self.recording.record(event, vb, arrival)
        if kind is not None:
            result.count(kind)
        if isinstance(event, upr.SnapshotMarker) and event.flags & upr.SnapshotFlags.ACK:
            self.send(upr.Response(upr.Command.SNAPSHOT_MARKER, event.opaque, _OK))
        elif isinstance(event, upr.StreamEnd):
            self.open.discard(vb)
            if event.reason == upr.StreamEndReason.OK and self.until:
                result.caught_up.add(vb)
            elif not self.until:
                log.warning("%s: stream of vbucket %d ended: %s", self.conn.name, vb, event.reason)
        elif isinstance(event, upr.Noop):
            self.send(upr.Response(upr.Command.NOOP, event.opaque, _OK))
        elif isinstance(event, upr.SetVbucketState) and not self.draft:
            self.send(upr.Response(upr.Command.SET_VBUCKET_STATE, event.opaque, _OK))
        elif isinstance(event, upr.StreamRequestRollback):
            raise CaptureFailed(
                f"STREAM_REQ for vbucket {self.vbucket_of(event)} from seqno 0: the server "
                f"asks to roll back to {event.rollback_seqno}"
            )
        elif (
            isinstance(event, upr.Response)
            and event.command == upr.Command.STREAM_REQ
            and event.status != _OK
        ):
            raise _refused(f"STREAM_REQ for vbucket {self.vbucket_of(event)}", event)
