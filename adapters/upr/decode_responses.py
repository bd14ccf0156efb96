"""Decoders of UPR responses, and the per-dialect decoder table.

Three responses carry data and decode to classes of their own when their
status says so: STREAM_REQ (success: the failover log; rollback: the seqno),
GET_FAILOVER_LOG (success: the log) and ADD_STREAM (the stream opaque). Every
other response, and those three with any other status, is a ``Response``
with the command, the status and the value (error text, usually).
"""

from __future__ import annotations

from collections.abc import Callable

from adapters.mcbp.constants import Magic, Status
from adapters.mcbp.frames import Frame
from adapters.upr.checks import NO, Decoder, DecoderBuilder, check, invalid
from adapters.upr.constants import Command
from adapters.upr.decode_requests import REQUEST_BUILDERS
from adapters.upr.dialect import Dialect
from adapters.upr.events import (
    UprEvent,
)
from adapters.upr.failover import decode_failover_log
from adapters.upr.layouts import U32, U64
from adapters.upr.responses import (
    AddStreamResponse,
    FailoverLogResponse,
    Response,
    StreamRequestOk,
    StreamRequestRollback,
)

_SUCCESS = Status.SUCCESS.value
_ROLLBACK = Status.ROLLBACK.value
_REQUEST = Magic.REQUEST.value << 8
_RESPONSE = Magic.RESPONSE.value << 8


def _generic_response(command: Command, what: str) -> Callable[[Frame], Response]:
    def decode(frame: Frame) -> Response:
        if frame.extras_length or frame.key_length:
            check(frame, what, 0, NO, True, "key")
        return Response(command, frame.opaque, frame.vbucket_or_status, frame.body)

    return decode


def _stream_request_response(dialect: Dialect, what: str) -> Decoder:
    generic = _generic_response(Command.STREAM_REQ, what)

    def decode(frame: Frame) -> UprEvent:
        status = frame.vbucket_or_status
        if status == _SUCCESS:
            check(frame, what, 0, NO, True, "key")
            return StreamRequestOk(decode_failover_log(frame.body, frame.opcode), frame.opaque)
        if status != _ROLLBACK:
            return generic(frame)
        # Released servers put the seqno in the value; the draft and one
        # document example put it in the extras. Either is accepted.
        if len(frame.body) == 8 and frame.key_length == 0 and frame.extras_length in (0, 8):
            return StreamRequestRollback(U64.unpack_from(frame.body)[0], frame.opaque)
        raise invalid(
            frame,
            "rollback response must carry an 8-byte seqno in the value or the extras",
            "rollback_seqno",
            len(frame.body),
            8,
        )

    return decode


def _failover_log_response(dialect: Dialect, what: str) -> Decoder:
    generic = _generic_response(Command.GET_FAILOVER_LOG, what)

    def decode(frame: Frame) -> UprEvent:
        if frame.vbucket_or_status != _SUCCESS:
            return generic(frame)
        check(frame, what, 0, NO, True, "key")
        return FailoverLogResponse(decode_failover_log(frame.body, frame.opcode), frame.opaque)

    return decode


def _add_stream_response(dialect: Dialect, what: str) -> Decoder:
    generic = _generic_response(Command.ADD_STREAM, what)

    def decode(frame: Frame) -> UprEvent:
        status = frame.vbucket_or_status
        # Consumers send the 4-byte stream opaque even with an error status;
        # an error without it is a plain response.
        if status != _SUCCESS and frame.extras_length == 0:
            return generic(frame)
        check(frame, what, 4, NO, False, "key")
        return AddStreamResponse(U32.unpack_from(frame.body)[0], frame.opaque, status)

    return decode


RESPONSE_BUILDERS: dict[Command, DecoderBuilder] = {
    Command.STREAM_REQ: _stream_request_response,
    Command.GET_FAILOVER_LOG: _failover_log_response,
    Command.ADD_STREAM: _add_stream_response,
}


def build_decoders(dialect: Dialect) -> dict[int, Decoder]:
    """The decoder of every request and response the dialect has, by ``magic << 8 | opcode``."""
    table: dict[int, Decoder] = {}
    for command, opcode in dialect.opcodes.items():
        table[_REQUEST | opcode] = REQUEST_BUILDERS[command](dialect, command.name)
        what = f"{command.name} response"
        response = RESPONSE_BUILDERS.get(command)
        table[_RESPONSE | opcode] = (
            response(dialect, what) if response else _generic_response(command, what)
        )
    return table
