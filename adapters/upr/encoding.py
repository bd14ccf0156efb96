"""Event -> bytes encoders, built per dialect from its table.

Theory of operation. ``build_encoders(dialect)`` returns a dict from event
class to a closure with the dialect's opcode and structs bound, so encoding
is one lookup by ``type(event)`` and one call. A class the dialect has no
message for is simply absent from its table (``codec.encode`` turns that into
``LocalProtocolError``).

An encoder refuses, with ``LocalProtocolError``, any event its dialect cannot
carry without loss (a snapshot range in a draft stream request, metadata in a
draft mutation, a delete time in the 3.0 layout's place) and any event the
decoder would reject (an empty key or name), so whatever encodes decodes back
to an equal event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.errors import LocalProtocolError
from adapters.mcbp.constants import Magic, Status
from adapters.mcbp.frames import encode_frame
from adapters.upr.constants import Command
from adapters.upr.dialect import Dialect, ItemLayout
from adapters.upr.events import (
    REQUEST_CLASSES,
    AddStream,
    BufferAcknowledgement,
    Control,
    Deletion,
    Expiration,
    Mutation,
    Open,
    SetVbucketState,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
)
from adapters.upr.failover import encode_failover_log
from adapters.upr.layouts import OPEN_EXTRAS, SNAPSHOT_EXTRAS, U8, U32, U64
from adapters.upr.responses import (
    AddStreamResponse,
    FailoverLogResponse,
    Response,
    StreamRequestOk,
    StreamRequestRollback,
)

Encoder = Callable[[Any], bytes]
EncoderBuilder = Callable[[Dialect, int], Encoder]

_REQ = Magic.REQUEST.value
_RES = Magic.RESPONSE.value


def _refuse(what: str, reason: str) -> LocalProtocolError:
    return LocalProtocolError(f"cannot encode {what}: {reason}")


# --- requests ----------------------------------------------------------------


def _empty(dialect: Dialect, opcode: int) -> Encoder:
    def encode(event: Any) -> bytes:
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque)

    return encode


def _open(dialect: Dialect, opcode: int) -> Encoder:
    def encode(event: Open) -> bytes:
        if not event.name:
            raise _refuse("OPEN", "the connection name must not be empty")
        extras = OPEN_EXTRAS.pack(event.seqno, event.flags)
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, extras, event.name)

    return encode


def _add_stream(dialect: Dialect, opcode: int) -> Encoder:
    def encode(event: AddStream) -> bytes:
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, U32.pack(event.flags))

    return encode


def _stream_end(dialect: Dialect, opcode: int) -> Encoder:
    def encode(event: StreamEnd) -> bytes:
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, U32.pack(event.reason))

    return encode


def _buffer_ack(dialect: Dialect, opcode: int) -> Encoder:
    def encode(event: BufferAcknowledgement) -> bytes:
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, U32.pack(event.buffer_bytes))

    return encode


def _stream_request(dialect: Dialect, opcode: int) -> Encoder:
    layout = dialect.stream_request
    pack = layout.extras.pack
    where = f"STREAM_REQ in {dialect.name}"

    def encode(event: StreamRequest) -> bytes:
        if event.name and not layout.group_id:
            raise _refuse(where, "this dialect has no group id (name)")
        if layout.snapshot_range:
            if event.high_seqno:
                raise _refuse(where, "this dialect has no high_seqno")
            extras = pack(
                event.flags,
                0,
                event.start_seqno,
                event.end_seqno,
                event.vbucket_uuid,
                event.snap_start_seqno,
                event.snap_end_seqno,
            )
        else:
            if event.snap_start_seqno or event.snap_end_seqno:
                raise _refuse(where, "this dialect has no snapshot range")
            extras = pack(
                event.flags,
                0,
                event.start_seqno,
                event.end_seqno,
                event.vbucket_uuid,
                event.high_seqno,
            )
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, extras, event.name)

    return encode


def _snapshot_marker(dialect: Dialect, opcode: int) -> Encoder:
    def encode(event: SnapshotMarker) -> bytes:
        extras = SNAPSHOT_EXTRAS.pack(event.start_seqno, event.end_seqno, event.flags)
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, extras)

    return encode


def _mutation(dialect: Dialect, opcode: int) -> Encoder:
    layout = dialect.mutation
    pack = layout.extras.pack
    where = f"MUTATION in {dialect.name}"

    def encode(event: Mutation) -> bytes:
        if not event.key:
            raise _refuse(where, "the key must not be empty")
        if layout.meta:
            extras = pack(
                event.by_seqno,
                event.rev_seqno,
                event.flags,
                event.expiration,
                event.lock_time,
                len(event.meta),
                event.nru,
            )
        elif event.meta or event.nru:
            raise _refuse(where, "this dialect has no metadata or nru")
        else:
            extras = pack(
                event.by_seqno, event.rev_seqno, event.flags, event.expiration, event.lock_time
            )
        # Metadata travels after the value; the header counts it in the body.
        return encode_frame(
            _REQ,
            opcode,
            event.vbucket,
            event.opaque,
            extras,
            event.key,
            event.value + event.meta if event.meta else event.value,
            event.cas,
            event.datatype,
        )

    return encode


def _removal(layouts: Callable[[Dialect], tuple[ItemLayout, ...]]) -> EncoderBuilder:
    """DELETION and EXPIRATION: the event's ``delete_time`` picks the layout."""

    def build(dialect: Dialect, opcode: int) -> Encoder:
        with_time = next((x for x in layouts(dialect) if x.delete_time), None)
        without_time = next((x for x in layouts(dialect) if not x.delete_time), None)

        def encode(event: Deletion | Expiration) -> bytes:
            where = f"{event.NAME} in {dialect.name}"
            if not event.key:
                raise _refuse(where, "the key must not be empty")
            layout = without_time if event.delete_time is None else with_time
            if layout is None:
                form = "without" if event.delete_time is None else "with"
                raise _refuse(where, f"this dialect has no layout {form} a delete time")
            if event.meta and not layout.meta:
                raise _refuse(where, "this layout has no metadata")
            if layout.meta:
                extras = layout.extras.pack(event.by_seqno, event.rev_seqno, len(event.meta))
            elif layout.delete_time:
                extras = layout.extras.pack(event.by_seqno, event.rev_seqno, event.delete_time)
            else:
                extras = layout.extras.pack(event.by_seqno, event.rev_seqno)
            return encode_frame(
                _REQ,
                opcode,
                event.vbucket,
                event.opaque,
                extras,
                event.key,
                event.value + event.meta,
                event.cas,
                event.datatype,
            )

        return encode

    return build


def _set_vbucket_state(dialect: Dialect, opcode: int) -> Encoder:
    states = dialect.state_to_wire

    def encode(event: SetVbucketState) -> bytes:
        wire = states.get(event.state)
        if wire is None:
            raise _refuse("SET_VBUCKET_STATE", f"unknown state {event.state!r}")
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, U8.pack(wire))

    return encode


def _control(dialect: Dialect, opcode: int) -> Encoder:
    def encode(event: Control) -> bytes:
        if not event.key:
            raise _refuse("CONTROL", "the key must not be empty")
        return encode_frame(_REQ, opcode, event.vbucket, event.opaque, b"", event.key, event.value)

    return encode


_REQUEST_ENCODERS: dict[Command, EncoderBuilder] = {
    Command.OPEN: _open,
    Command.ADD_STREAM: _add_stream,
    Command.CLOSE_STREAM: _empty,
    Command.STREAM_REQ: _stream_request,
    Command.GET_FAILOVER_LOG: _empty,
    Command.STREAM_END: _stream_end,
    Command.SNAPSHOT_MARKER: _snapshot_marker,
    Command.MUTATION: _mutation,
    Command.DELETION: _removal(lambda d: d.deletion),
    Command.EXPIRATION: _removal(lambda d: d.expiration),
    Command.FLUSH: _empty,
    Command.SET_VBUCKET_STATE: _set_vbucket_state,
    Command.NOOP: _empty,
    Command.BUFFER_ACKNOWLEDGEMENT: _buffer_ack,
    Command.CONTROL: _control,
    Command.STREAM_START: _empty,
    Command.SNAPSHOT_START: _empty,
    Command.SNAPSHOT_END: _empty,
}


# --- responses ---------------------------------------------------------------

# (command, status) pairs that have a response class of their own: a generic
# Response with them would decode as that class, so it is refused.
_SPECIFIC = {
    (Command.STREAM_REQ, Status.SUCCESS.value): "StreamRequestOk",
    (Command.STREAM_REQ, Status.ROLLBACK.value): "StreamRequestRollback",
    (Command.GET_FAILOVER_LOG, Status.SUCCESS.value): "FailoverLogResponse",
    (Command.ADD_STREAM, Status.SUCCESS.value): "AddStreamResponse",
}


def _response_encoders(dialect: Dialect) -> dict[type, Encoder]:
    opcodes = dialect.opcodes
    table: dict[type, Encoder] = {}

    def response(event: Response) -> bytes:
        opcode = opcodes.get(event.command)
        if opcode is None:
            raise _refuse(f"{event.command.name} response", f"not in {dialect.name}")
        specific = _SPECIFIC.get((event.command, event.status))
        if specific is not None:
            raise _refuse(f"{event.command.name} response", f"use {specific} for this status")
        return encode_frame(_RES, opcode, event.status, event.opaque, b"", b"", event.value)

    table[Response] = response

    stream_req = opcodes.get(Command.STREAM_REQ)
    if stream_req is not None:
        in_extras = dialect.rollback_in_extras
        rollback_status = Status.ROLLBACK.value

        def stream_ok(event: StreamRequestOk) -> bytes:
            value = encode_failover_log(event.failover_log)
            return encode_frame(_RES, stream_req, 0, event.opaque, b"", b"", value)

        def rollback(event: StreamRequestRollback) -> bytes:
            seqno = U64.pack(event.rollback_seqno)
            if in_extras:
                return encode_frame(_RES, stream_req, rollback_status, event.opaque, seqno)
            return encode_frame(_RES, stream_req, rollback_status, event.opaque, b"", b"", seqno)

        table[StreamRequestOk] = stream_ok
        table[StreamRequestRollback] = rollback

    failover = opcodes.get(Command.GET_FAILOVER_LOG)
    if failover is not None:

        def failover_log(event: FailoverLogResponse) -> bytes:
            value = encode_failover_log(event.failover_log)
            return encode_frame(_RES, failover, 0, event.opaque, b"", b"", value)

        table[FailoverLogResponse] = failover_log

    add_stream = opcodes.get(Command.ADD_STREAM)
    if add_stream is not None:

        def add_stream_response(event: AddStreamResponse) -> bytes:
            extras = U32.pack(event.stream_opaque)
            return encode_frame(_RES, add_stream, event.status, event.opaque, extras)

        table[AddStreamResponse] = add_stream_response

    return table


def build_encoders(dialect: Dialect) -> dict[type, Encoder]:
    """The encoder of every event class the dialect can send, by class."""
    table: dict[type, Encoder] = {
        REQUEST_CLASSES[command]: _REQUEST_ENCODERS[command](dialect, opcode)
        for command, opcode in dialect.opcodes.items()
    }
    table.update(_response_encoders(dialect))
    return table
