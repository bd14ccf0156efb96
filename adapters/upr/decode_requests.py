"""Decoders of UPR requests, one builder per command.

Theory of operation. A builder takes the dialect and the message's name and
returns a closure that turns a ``Frame`` into an event, with the dialect's
structs and maps bound as locals; ``codec`` calls every builder once per
dialect and keeps the closures in a table keyed by magic and opcode. So a
packet costs one dict lookup and one call: no per-packet branching on the
dialect, no dict building, no isinstance chain.

Each decoder checks only what one packet can show: the extras length, a key
where one is required (and none where the message has no place for one), a
value only where the message carries one, a known vbucket state, metadata
that fits the body. Rules that need context (seqno ranges, stream state) are
the state machines' business: a server answers those with a status, it does
not treat the packet as malformed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.errors import ProtocolError
from adapters.fastinit import positional_constructor
from adapters.mcbp.constants import HEADER_SIZE
from adapters.mcbp.frames import Frame
from adapters.upr.checks import (
    MAY,
    MUST,
    NO,
    Decoder,
    DecoderBuilder,
    bad_extras,
    check,
    invalid,
    meta_overrun,
)
from adapters.upr.constants import (
    Command,
    OpenFlags,
    SnapshotFlags,
    StreamEndReason,
    StreamFlags,
)
from adapters.upr.dialect import Dialect, ItemLayout
from adapters.upr.events import (
    AddStream,
    BufferAcknowledgement,
    CloseStream,
    Control,
    Deletion,
    Expiration,
    Flush,
    GetFailoverLog,
    Mutation,
    Noop,
    Open,
    SetVbucketState,
    SnapshotEnd,
    SnapshotMarker,
    SnapshotStart,
    StreamEnd,
    StreamRequest,
    StreamStart,
    UprEvent,
)
from adapters.upr.layouts import OPEN_EXTRAS, SNAPSHOT_EXTRAS, U8, U32

# IntFlag construction is slow; the flag values seen in practice are cached.
_OPEN_FLAGS = {v: OpenFlags(v) for v in range(64)}
_STREAM_FLAGS = {v: StreamFlags(v) for v in range(8)}
_SNAPSHOT_FLAGS = {v: SnapshotFlags(v) for v in range(16)}
_REASONS: dict[int, StreamEndReason | int] = {r.value: r for r in StreamEndReason}


def _empty(cls: Callable[[int, int], UprEvent]) -> DecoderBuilder:
    """Messages with no body at all: opaque and vbucket are everything."""

    def build(dialect: Dialect, what: str) -> Decoder:
        def decode(frame: Frame) -> UprEvent:
            if frame.body:
                check(frame, what, 0, NO, False, "key")
            return cls(frame.opaque, frame.vbucket_or_status)

        return decode

    return build


def _open(dialect: Dialect, what: str) -> Decoder:
    def decode(frame: Frame) -> Open:
        # memcached 3.0 ``dcp_open_validator`` ignores the body length: a
        # value after the name passes, and nothing reads it.
        check(frame, what, 8, MUST, True, "name")
        seqno, flags = OPEN_EXTRAS.unpack_from(frame.body)
        known = _OPEN_FLAGS.get(flags)
        return Open(
            name=frame.key,
            flags=OpenFlags(flags) if known is None else known,
            seqno=seqno,
            opaque=frame.opaque,
            vbucket=frame.vbucket_or_status,
        )

    return decode


def _u32_request(
    cls: Callable[[Any, int, int], UprEvent], convert: Callable[[int], Any] = int
) -> DecoderBuilder:
    """Messages whose only content is a u32 in the extras."""

    def build(dialect: Dialect, what: str) -> Decoder:
        def decode(frame: Frame) -> UprEvent:
            check(frame, what, 4, NO, False, "key")
            raw = U32.unpack_from(frame.body)[0]
            return cls(convert(raw), frame.opaque, frame.vbucket_or_status)

        return decode

    return build


def _stream_flags(raw: int) -> StreamFlags:
    flags = _STREAM_FLAGS.get(raw)
    return StreamFlags(raw) if flags is None else flags


def _reason(raw: int) -> StreamEndReason | int:
    return _REASONS.get(raw, raw)


def _stream_request(dialect: Dialect, what: str) -> Decoder:
    layout = dialect.stream_request
    unpack = layout.extras.unpack_from
    size = layout.extras.size
    key_rule = MAY if layout.group_id else NO
    snapshot_range = layout.snapshot_range

    def decode(frame: Frame) -> StreamRequest:
        check(frame, what, size, key_rule, True, "name")  # a value: as OPEN's
        if snapshot_range:
            flags, _, start, end, uuid, snap_start, snap_end = unpack(frame.body)
            high = 0
        else:
            flags, _, start, end, uuid, high = unpack(frame.body)
            snap_start = snap_end = 0
        return StreamRequest(
            flags=_stream_flags(flags),
            start_seqno=start,
            end_seqno=end,
            vbucket_uuid=uuid,
            snap_start_seqno=snap_start,
            snap_end_seqno=snap_end,
            high_seqno=high,
            name=frame.key,
            opaque=frame.opaque,
            vbucket=frame.vbucket_or_status,
        )

    return decode


def _snapshot_marker(dialect: Dialect, what: str) -> Decoder:
    def decode(frame: Frame) -> SnapshotMarker:
        check(frame, what, SNAPSHOT_EXTRAS.size, NO, False, "key")
        start, end, flags = SNAPSHOT_EXTRAS.unpack_from(frame.body)
        known = _SNAPSHOT_FLAGS.get(flags)
        return SnapshotMarker(
            start_seqno=start,
            end_seqno=end,
            flags=SnapshotFlags(flags) if known is None else known,
            opaque=frame.opaque,
            vbucket=frame.vbucket_or_status,
        )

    return decode


def _set_vbucket_state(dialect: Dialect, what: str) -> Decoder:
    states = dialect.state_from_wire

    def decode(frame: Frame) -> SetVbucketState:
        check(frame, what, 1, NO, False, "key")
        raw = U8.unpack_from(frame.body)[0]
        state = states.get(raw)
        if state is None:
            raise invalid(frame, "unknown vbucket state", "state", raw, HEADER_SIZE)
        return SetVbucketState(state, frame.opaque, frame.vbucket_or_status)

    return decode


def _control(dialect: Dialect, what: str) -> Decoder:
    def decode(frame: Frame) -> Control:
        check(frame, what, 0, MUST, True, "key")
        return Control(frame.key, frame.value, frame.opaque, frame.vbucket_or_status)

    return decode


def _mutation(dialect: Dialect, what: str) -> Decoder:
    # The hot path: one tuple unpack of the frame, one struct unpack, slices,
    # and the positional constructor (every field, in declaration order).
    make = positional_constructor(Mutation)
    layout = dialect.mutation
    unpack = layout.extras.unpack_from
    size = layout.size

    def shape_error(frame: Frame) -> ProtocolError:
        if frame.extras_length != size:
            return bad_extras(frame, what, str(size))
        return invalid(frame, f"{what} requires a non-empty key", "key", 0, 2)

    if layout.meta:

        def decode(frame: Frame) -> Mutation:
            _, _, keylen, extlen, datatype, vbucket, opaque, cas, body = frame
            if extlen != size or not keylen:
                raise shape_error(frame)
            by_seqno, rev_seqno, flags, expiration, lock_time, nmeta, nru = unpack(body)
            key_end = size + keylen
            value_end = len(body) - nmeta
            if value_end < key_end:
                raise meta_overrun(frame, nmeta, size - 3)
            return make(
                body[size:key_end],  # key
                body[key_end:value_end],  # value
                by_seqno,
                rev_seqno,
                flags,
                expiration,
                lock_time,
                nru,
                body[value_end:],  # meta
                cas,
                datatype,
                opaque,
                vbucket,
            )

        return decode

    def decode_plain(frame: Frame) -> Mutation:
        _, _, keylen, extlen, datatype, vbucket, opaque, cas, body = frame
        if extlen != size or not keylen:
            raise shape_error(frame)
        by_seqno, rev_seqno, flags, expiration, lock_time = unpack(body)
        key_end = size + keylen
        return make(
            body[size:key_end],  # key
            body[key_end:],  # value
            by_seqno,
            rev_seqno,
            flags,
            expiration,
            lock_time,
            0,  # nru
            b"",  # meta
            cas,
            datatype,
            opaque,
            vbucket,
        )

    return decode_plain


def _removal(
    cls: type[Deletion] | type[Expiration], layouts: Callable[[Dialect], tuple[ItemLayout, ...]]
) -> DecoderBuilder:
    """DELETION and EXPIRATION: the layout is chosen by the extras length."""

    make = positional_constructor(cls)

    def build(dialect: Dialect, what: str) -> Decoder:
        by_size = {layout.size: layout for layout in layouts(dialect)}
        sizes = " or ".join(str(size) for size in sorted(by_size))

        def decode(frame: Frame) -> UprEvent:
            _, _, keylen, extlen, datatype, vbucket, opaque, cas, body = frame
            layout = by_size.get(extlen)
            if layout is None:
                raise bad_extras(frame, what, sizes)
            if not keylen:
                raise invalid(frame, f"{what} requires a non-empty key", "key", 0, 2)
            fields = layout.extras.unpack_from(body)
            nmeta = fields[2] if layout.meta else 0
            key_end = extlen + keylen
            value_end = len(body) - nmeta
            if value_end < key_end:
                raise meta_overrun(frame, nmeta, 16)
            return make(
                body[extlen:key_end],  # key
                fields[0],  # by_seqno
                fields[1],  # rev_seqno
                body[value_end:],  # meta
                fields[2] if layout.delete_time else None,  # delete_time
                body[key_end:value_end],  # value
                cas,
                datatype,
                opaque,
                vbucket,
            )

        return decode

    return build


REQUEST_BUILDERS: dict[Command, DecoderBuilder] = {
    Command.OPEN: _open,
    Command.ADD_STREAM: _u32_request(AddStream, _stream_flags),
    Command.CLOSE_STREAM: _empty(CloseStream),
    Command.STREAM_REQ: _stream_request,
    Command.GET_FAILOVER_LOG: _empty(GetFailoverLog),
    Command.STREAM_END: _u32_request(StreamEnd, _reason),
    Command.SNAPSHOT_MARKER: _snapshot_marker,
    Command.MUTATION: _mutation,
    Command.DELETION: _removal(Deletion, lambda d: d.deletion),
    Command.EXPIRATION: _removal(Expiration, lambda d: d.expiration),
    Command.FLUSH: _empty(Flush),
    Command.SET_VBUCKET_STATE: _set_vbucket_state,
    Command.NOOP: _empty(Noop),
    Command.BUFFER_ACKNOWLEDGEMENT: _u32_request(BufferAcknowledgement),
    Command.CONTROL: _control,
    Command.STREAM_START: _empty(StreamStart),
    Command.SNAPSHOT_START: _empty(SnapshotStart),
    Command.SNAPSHOT_END: _empty(SnapshotEnd),
}
