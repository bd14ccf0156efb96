"""TAP codec: frames to events and events to bytes.

Every TAP message a producer sends starts its body with the 8-byte TAP
header (engine-specific length u16, TAP flags u16, TTL u8, 3 reserved);
MUTATION (and the server layout of CHECKPOINT_START/END) follow it with item
flags u32 and expiration u32. The engine-specific bytes come next, then the
key, then the value. Servers never checked the header's extras length on
these messages and one orchestrator sent the TAP header in the value, so the
decoder parses by these fixed offsets from the start of the body and trusts
only the key length. Offsets in errors count from the start of the packet.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from adapters.errors import LocalProtocolError, ProtocolError
from adapters.fastinit import positional_constructor
from adapters.mcbp.constants import HEADER_SIZE, Magic, Opcode, Status, VBucketState
from adapters.mcbp.frames import DEFAULT_MAX_FRAME_SIZE, Frame, FrameReader, encode_frame
from adapters.tap.constants import (
    CHECKPOINT_KEYS,
    CheckpointLayout,
    ConnectFlags,
    OpaqueCode,
    TapFlags,
    TapOpcode,
)
from adapters.tap.events import (
    EncodedTapFrame,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapConnect,
    TapDelete,
    TapEvent,
    TapFlush,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapResponse,
    TapVbucketSet,
)

_TAP_HEADER = struct.Struct(">HHB3x")
_MUTATION_EXTRAS = struct.Struct(">HHB3xII")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_REV_NRU = struct.Struct(">QB")
_VB_CHECKPOINT = struct.Struct(">HQ")

_REQUEST = Magic.REQUEST.value
_RESPONSE = Magic.RESPONSE.value
_INVALID = Status.INVALID_ARGUMENTS.value
_BAD_CONNECT = Status.NOT_SUPPORTED.value
_BODY = HEADER_SIZE  # packet offset of the first body byte

# IntFlag construction is slow; the few flag combinations seen are cached.
_TAP_FLAGS = {value: TapFlags(value) for value in range(8)}
_OPAQUE_CODES = {code.value: code for code in OpaqueCode}
_STATES = {state.value: state for state in VBucketState}
_TAP_OPCODES = {opcode.value: opcode for opcode in TapOpcode}


_make_mutation = positional_constructor(TapMutation)
_make_delete = positional_constructor(TapDelete)


def _tap_flags(value: int) -> TapFlags:
    flags = _TAP_FLAGS.get(value)
    return flags if flags is not None else TapFlags(value)


# --- decoding ---------------------------------------------------------------


def _need_body(frame: Frame, size: int, what: str) -> bytes:
    body = frame.body
    if len(body) < size:
        raise ProtocolError(
            f"body of {len(body)} bytes is shorter than the {size}-byte {what}",
            opcode=frame.opcode,
            field="total_body",
            value=len(body),
            offset=8,
            status=_INVALID,
        )
    return body


def _key_bounds(frame: Frame, key_start: int, es_len: int) -> tuple[int, int]:
    key_end = key_start + frame.key_length
    if key_end > len(frame.body):
        raise ProtocolError(
            "engine-specific length runs past the body",
            opcode=frame.opcode,
            field="engine_specific_length",
            value=es_len,
            offset=_BODY,
            status=_INVALID,
        )
    return key_start, key_end


def _rev_meta(frame: Frame, body: bytes, at: int, es_len: int) -> tuple[int | None, int | None]:
    """2.x engine-specific data, read as 2.5.1's consumer reads it (ep_engine.cc
    ``tapNotify``): a mutation has metadata from 8 bytes on (rev_seqno, then nru when
    there are exactly 9), a delete with exactly 8; any other length is no metadata."""
    if es_len == 8 or (es_len > 8 and frame.opcode == TapOpcode.MUTATION):
        rev = _U64.unpack_from(body, at)[0]
        return rev, body[at + 8] if es_len == 9 else None
    return None, None


def _decode_mutation(frame: Frame) -> TapMutation:
    body = _need_body(frame, 16, "mutation extras")
    es_len, tap_flags, ttl, item_flags, expiration = _MUTATION_EXTRAS.unpack_from(body)
    key_start, key_end = _key_bounds(frame, 16 + es_len, es_len)
    if key_end == key_start:
        raise ProtocolError(
            "mutation without a key",
            opcode=frame.opcode,
            field="key_length",
            value=0,
            offset=2,
            status=_INVALID,
        )
    rev_seqno, nru = _rev_meta(frame, body, 16, es_len)
    return _make_mutation(
        body[key_start:key_end],
        body[key_end:],
        frame.vbucket_or_status,
        frame.opaque,
        frame.cas,
        item_flags,
        expiration,
        rev_seqno,
        nru,
        _tap_flags(tap_flags),
        ttl,
        frame.datatype,
    )


def _decode_delete(frame: Frame) -> TapDelete:
    body = _need_body(frame, 8, "TAP header")
    es_len, tap_flags, ttl = _TAP_HEADER.unpack_from(body)
    key_start, key_end = _key_bounds(frame, 8 + es_len, es_len)
    if key_end == key_start:
        raise ProtocolError(
            "delete without a key",
            opcode=frame.opcode,
            field="key_length",
            value=0,
            offset=2,
            status=_INVALID,
        )
    rev_seqno, _ = _rev_meta(frame, body, 8, es_len)
    # Some servers send the old value after the key; a delete has no use for it.
    return _make_delete(
        body[key_start:key_end],
        frame.vbucket_or_status,
        frame.opaque,
        frame.cas,
        rev_seqno,
        _tap_flags(tap_flags),
        ttl,
    )


def _decode_flush(frame: Frame) -> TapFlush:
    body = _need_body(frame, 8, "TAP header")
    _, tap_flags, ttl = _TAP_HEADER.unpack_from(body)
    return TapFlush(frame.vbucket_or_status, frame.opaque, _tap_flags(tap_flags), ttl)


def _decode_opaque(frame: Frame) -> TapOpaque:
    body = _need_body(frame, 8, "TAP header")
    es_len, tap_flags, ttl = _TAP_HEADER.unpack_from(body)
    if es_len == 4:
        body = _need_body(frame, 12, "TAP header and opaque code")
    # Another length is no code, which the consumer warns about and ignores (2.5.1
    # ep_engine.cc ``tapNotify``): not a malformed packet.
    raw = _U32.unpack_from(body, 8)[0] if len(body) >= 12 else 0
    code: OpaqueCode | int = _OPAQUE_CODES.get(raw, raw)
    return TapOpaque(
        code, frame.vbucket_or_status, frame.opaque, _tap_flags(tap_flags), ttl, es_len
    )


def _decode_vbucket_set(frame: Frame) -> TapVbucketSet:
    body = _need_body(frame, 12, "TAP header and vbucket state")
    es_len, tap_flags, ttl = _TAP_HEADER.unpack_from(body)
    if es_len != 4:
        # 2.x ep_engine.cc ``tapNotify``: "Received TAP_VBUCKET_SET with illegal
        # size. Force disconnect" (the state is the 4 engine-specific bytes).
        raise ProtocolError(
            "VBUCKET_SET's state is 4 engine-specific bytes",
            opcode=frame.opcode,
            field="engine_specific_length",
            value=es_len,
            offset=_BODY,
            status=_INVALID,
        )
    raw = _U32.unpack_from(body, 8)[0]
    state = _STATES.get(raw)
    if state is None:
        raise ProtocolError(
            "unknown vbucket state",
            opcode=frame.opcode,
            field="state",
            value=raw,
            offset=_BODY + 8,
            status=_INVALID,
        )
    return TapVbucketSet(state, frame.vbucket_or_status, frame.opaque, _tap_flags(tap_flags), ttl)


def _decode_checkpoint(frame: Frame) -> TapCheckpointStart | TapCheckpointEnd:
    cls = TapCheckpointStart if frame.opcode == TapOpcode.CHECKPOINT_START else TapCheckpointEnd
    if frame.key_length or frame.extras_length == 16:
        # Server layout: a mutation whose key names the message and whose value is the id.
        body = _need_body(frame, 16, "mutation extras")
        es_len, tap_flags, ttl, _, _ = _MUTATION_EXTRAS.unpack_from(body)
        _, key_end = _key_bounds(frame, 16 + es_len, es_len)
        if len(body) - key_end != 8:
            raise ProtocolError(
                "checkpoint id must be an 8-byte value",
                opcode=frame.opcode,
                field="checkpoint_id",
                value=len(body) - key_end,
                offset=_BODY + key_end,
                status=_INVALID,
            )
        engine_specific = body[16 : 16 + es_len]
        layout = CheckpointLayout.SERVER
    else:
        # Document layout: TAP header, then the id. Its engine-specific length
        # is unreliable (the document prints 4 with no such bytes), so the id
        # is the last 8 bytes and anything between is engine-specific.
        body = _need_body(frame, 16, "TAP header and checkpoint id")
        es_len, tap_flags, ttl = _TAP_HEADER.unpack_from(body)
        engine_specific = body[8:-8]
        layout = CheckpointLayout.DOCUMENT
    checkpoint_id = _U64.unpack_from(body, len(body) - 8)[0]
    return cls(
        checkpoint_id,
        frame.vbucket_or_status,
        frame.opaque,
        frame.cas,
        _tap_flags(tap_flags),
        ttl,
        layout,
        engine_specific,
    )


def _bad_connect(reason: str, field: str, value: object, offset: int) -> ProtocolError:
    return ProtocolError(
        reason,
        opcode=TapOpcode.CONNECT,
        field=field,
        value=value,
        offset=offset,
        status=_BAD_CONNECT,
    )


def _decode_connect(frame: Frame) -> TapConnect:
    if frame.extras_length == 4:
        flags = ConnectFlags(_U32.unpack_from(frame.body)[0])
    elif frame.extras_length == 0:
        flags = ConnectFlags(0)
    else:
        raise _bad_connect(
            "CONNECT extras must be 0 or 4 bytes", "extras_length", frame.extras_length, 4
        )
    value = frame.value
    base = _BODY + frame.extras_length + frame.key_length
    pos = 0

    def take(size: int, field: str) -> int:
        nonlocal pos
        if pos + size > len(value):
            raise _bad_connect(
                f"CONNECT value ends inside {field}", field, len(value) - pos, base + pos
            )
        start, pos = pos, pos + size
        return start

    backfill_date = None
    vbuckets: tuple[int, ...] = ()
    checkpoints: tuple[tuple[int, int], ...] = ()
    registered_byte = None
    if flags & ConnectFlags.BACKFILL:
        backfill_date = _U64.unpack_from(value, take(8, "backfill_date"))[0]
    if flags & ConnectFlags.LIST_VBUCKETS:
        count = _U16.unpack_from(value, take(2, "vbuckets"))[0]
        at = take(2 * count, "vbuckets")
        vbuckets = struct.unpack_from(f">{count}H", value, at)
    # The checkpoint map is optional: no count (fewer than 2 bytes left) is none.
    if flags & ConnectFlags.CHECKPOINT and len(value) - pos >= 2:
        count = _U16.unpack_from(value, take(2, "checkpoints"))[0]
        at = take(10 * count, "checkpoints")
        checkpoints = tuple(_VB_CHECKPOINT.iter_unpack(value[at : at + 10 * count]))
    if flags & ConnectFlags.REGISTERED_CLIENT and pos < len(value):
        registered_byte = _U8.unpack_from(value, take(1, "registered_byte"))[0]
    # Bytes after the known options (data of a flag this codec does not know,
    # say) are ignored, as ep-engine's createTapQueue ignored them.
    return TapConnect(
        frame.key, flags, backfill_date, vbuckets, checkpoints, registered_byte, frame.opaque
    )


def _decode_noop(frame: Frame) -> TapNoop:
    return TapNoop(frame.opaque)


_REQUEST_DECODERS: dict[int, Callable[[Frame], TapEvent]] = {
    TapOpcode.CONNECT: _decode_connect,
    TapOpcode.MUTATION: _decode_mutation,
    TapOpcode.DELETE: _decode_delete,
    TapOpcode.FLUSH: _decode_flush,
    TapOpcode.OPAQUE: _decode_opaque,
    TapOpcode.VBUCKET_SET: _decode_vbucket_set,
    TapOpcode.CHECKPOINT_START: _decode_checkpoint,
    TapOpcode.CHECKPOINT_END: _decode_checkpoint,
    Opcode.NOOP: _decode_noop,
}


def is_tap_opcode(opcode: int) -> bool:
    """True for the opcodes this codec decodes (TAP's own and NOOP)."""
    return opcode in _REQUEST_DECODERS


def decode_frame(frame: Frame) -> TapEvent:
    """Decode one frame; raises ``ProtocolError`` (offsets within the packet)."""
    if frame.magic == _REQUEST:
        decoder = _REQUEST_DECODERS.get(frame.opcode)
        if decoder is not None:
            return decoder(frame)
    elif frame.opcode == Opcode.NOOP:
        return TapNoopResponse(frame.opaque, frame.vbucket_or_status)
    else:
        opcode = _TAP_OPCODES.get(frame.opcode)
        if opcode is not None:
            # Only opaque and status count (2.x read nothing else); the text a nack
            # carries is the whole body, whatever key or extras length its header claims.
            return TapResponse(opcode, frame.opaque, frame.vbucket_or_status, frame.body)
    raise ProtocolError(
        "not a TAP opcode",
        opcode=frame.opcode,
        field="opcode",
        value=frame.opcode,
        offset=1,
        status=Status.UNKNOWN_COMMAND,
    )


class TapDecoder:
    """Incremental TAP decoder: feed bytes, take events.

    ``next_event`` returns ``None`` when it needs more bytes; a
    ``ProtocolError`` carries the absolute stream offset of the problem.
    Responses (acks, nacks) are framed by their body length alone, as 2.x
    servers read them; requests must be consistent.
    """

    __slots__ = ("_reader",)

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._reader = FrameReader(max_frame_size, lenient_responses=True)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._reader.receive_data(data)

    @property
    def buffered(self) -> int:
        return self._reader.buffered

    def next_event(self) -> TapEvent | None:
        reader = self._reader
        start = reader.consumed
        frame = reader.next_frame()
        if frame is None:
            return None
        try:
            return decode_frame(frame)
        except ProtocolError as exc:
            raise exc.at(start) from None

    def events(self) -> list[TapEvent]:
        out = []
        while (event := self.next_event()) is not None:
            out.append(event)
        return out


# --- encoding ---------------------------------------------------------------


def _rev_bytes(rev_seqno: int | None, nru: int | None) -> bytes:
    if rev_seqno is None:
        if nru is not None:
            raise LocalProtocolError("nru travels only after a rev_seqno")
        return b""
    return _U64.pack(rev_seqno) if nru is None else _REV_NRU.pack(rev_seqno, nru)


def _encode_mutation(event: TapMutation) -> bytes:
    meta = _rev_bytes(event.rev_seqno, event.nru)
    extras = _MUTATION_EXTRAS.pack(
        len(meta), event.tap_flags, event.ttl, event.flags, event.expiration
    )
    return encode_frame(
        _REQUEST,
        TapOpcode.MUTATION,
        vbucket_or_status=event.vbucket,
        opaque=event.opaque,
        cas=event.cas,
        extras=extras + meta,
        key=event.key,
        value=event.value,
        datatype=event.datatype,
        extras_length=16,
    )


def _encode_delete(event: TapDelete) -> bytes:
    meta = _rev_bytes(event.rev_seqno, None)
    return encode_frame(
        _REQUEST,
        TapOpcode.DELETE,
        vbucket_or_status=event.vbucket,
        opaque=event.opaque,
        cas=event.cas,
        extras=_TAP_HEADER.pack(len(meta), event.tap_flags, event.ttl) + meta,
        key=event.key,
        extras_length=8,
    )


def _encode_flush(event: TapFlush) -> bytes:
    return encode_frame(
        _REQUEST,
        TapOpcode.FLUSH,
        vbucket_or_status=event.vbucket,
        opaque=event.opaque,
        extras=_TAP_HEADER.pack(0, event.tap_flags, event.ttl),
    )


def _encode_u32_message(
    opcode: int, event: TapOpaque | TapVbucketSet, code: int, es_len: int = 4
) -> bytes:
    return encode_frame(
        _REQUEST,
        opcode,
        vbucket_or_status=event.vbucket,
        opaque=event.opaque,
        extras=_TAP_HEADER.pack(es_len, event.tap_flags, event.ttl) + _U32.pack(code),
        extras_length=8,
    )


def _encode_opaque(event: TapOpaque) -> bytes:
    # Another engine-specific length than 4 is written as given (a peer's fault to
    # reproduce), still followed by the 4 code bytes.
    return _encode_u32_message(
        TapOpcode.OPAQUE, event, int(event.opaque_code), event.engine_specific_length
    )


def _encode_vbucket_set(event: TapVbucketSet) -> bytes:
    return _encode_u32_message(TapOpcode.VBUCKET_SET, event, int(event.state))


def _encode_checkpoint(event: TapCheckpointStart | TapCheckpointEnd) -> bytes:
    opcode = (
        TapOpcode.CHECKPOINT_START
        if isinstance(event, TapCheckpointStart)
        else TapOpcode.CHECKPOINT_END
    )
    es = event.engine_specific
    checkpoint_id = _U64.pack(event.checkpoint_id)
    if event.layout == CheckpointLayout.SERVER:
        extras = _MUTATION_EXTRAS.pack(len(es), event.tap_flags, event.ttl, 0, 0)
        return encode_frame(
            _REQUEST,
            opcode,
            vbucket_or_status=event.vbucket,
            opaque=event.opaque,
            cas=event.cas,
            extras=extras + es,
            key=CHECKPOINT_KEYS[opcode],
            value=checkpoint_id,
            extras_length=16,
        )
    return encode_frame(
        _REQUEST,
        opcode,
        vbucket_or_status=event.vbucket,
        opaque=event.opaque,
        cas=event.cas,
        extras=_TAP_HEADER.pack(len(es), event.tap_flags, event.ttl),
        value=es + checkpoint_id,
    )


def _encode_connect(event: TapConnect) -> bytes:
    flags = event.connect_flags
    parts = []
    if flags & ConnectFlags.BACKFILL:
        parts.append(_U64.pack(event.backfill_date or 0))
    if flags & ConnectFlags.LIST_VBUCKETS:
        parts.append(struct.pack(f">H{len(event.vbuckets)}H", len(event.vbuckets), *event.vbuckets))
    if flags & ConnectFlags.CHECKPOINT:
        parts.append(_U16.pack(len(event.checkpoints)))
        parts.extend(_VB_CHECKPOINT.pack(vb, cp) for vb, cp in event.checkpoints)
    if flags & ConnectFlags.REGISTERED_CLIENT and event.registered_byte is not None:
        parts.append(_U8.pack(event.registered_byte))
    return encode_frame(
        _REQUEST,
        TapOpcode.CONNECT,
        opaque=event.opaque,
        extras=_U32.pack(flags),
        key=event.name,
        value=b"".join(parts),
    )


def _encode_response(event: TapResponse) -> bytes:
    return encode_frame(
        _RESPONSE,
        event.opcode,
        vbucket_or_status=event.status,
        opaque=event.opaque,
        value=event.text,
    )


def _encode_noop(event: TapNoop) -> bytes:
    return encode_frame(_REQUEST, Opcode.NOOP, opaque=event.opaque)


def _encode_noop_response(event: TapNoopResponse) -> bytes:
    return encode_frame(_RESPONSE, Opcode.NOOP, vbucket_or_status=event.status, opaque=event.opaque)


_ENCODERS: dict[type, Callable[..., bytes]] = {
    TapConnect: _encode_connect,
    TapMutation: _encode_mutation,
    TapDelete: _encode_delete,
    TapFlush: _encode_flush,
    TapOpaque: _encode_opaque,
    TapVbucketSet: _encode_vbucket_set,
    TapCheckpointStart: _encode_checkpoint,
    TapCheckpointEnd: _encode_checkpoint,
    TapResponse: _encode_response,
    TapNoop: _encode_noop,
    TapNoopResponse: _encode_noop_response,
}


_OPAQUE = struct.Struct(">I")
_OPAQUE_AT = 12
_TAP_FLAGS_AT = HEADER_SIZE + 2


def _encode_encoded(event: EncodedTapFrame) -> bytes:
    frame = bytearray(event.frame)
    _OPAQUE.pack_into(frame, _OPAQUE_AT, event.opaque)
    _U16.pack_into(frame, _TAP_FLAGS_AT, int(event.tap_flags))
    return bytes(frame)


def encode(event: TapEvent | EncodedTapFrame) -> bytes:
    """Serialise one TAP event (or re-stamp a kept frame)."""
    if type(event) is EncodedTapFrame:
        return _encode_encoded(event)
    return _ENCODERS[type(event)](event)
