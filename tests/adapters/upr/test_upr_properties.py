"""Property tests of the UPR codec, in both dialects.

Round trips of every event type a dialect has, any chunking of a valid
stream, and arbitrary bytes (raw, and framed with UPR opcodes so they reach
the decoders) that must yield events or ``ProtocolError`` and nothing else.
The strategies read the dialect's own table (which layouts it has) to build
only events that dialect can carry.
"""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from adapters.upr import (
    DCP,
    UPR_DRAFT,
    AddStream,
    AddStreamResponse,
    BufferAcknowledgement,
    Command,
    Control,
    Deletion,
    Dialect,
    Expiration,
    FailoverLogResponse,
    Mutation,
    Open,
    OpenFlags,
    Response,
    SetVbucketState,
    SnapshotFlags,
    SnapshotMarker,
    StreamEnd,
    StreamEndReason,
    StreamFlags,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    UprDecoder,
    UprEvent,
    VBucketState,
    encode,
)
from adapters.upr.events import REQUEST_CLASSES
from tests.support.fuzzing import drain

DIALECTS = (DCP, UPR_DRAFT)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
keys = st.binary(min_size=1, max_size=40)
values = st.binary(max_size=200)
failover_logs = st.lists(st.tuples(u64, u64), max_size=25).map(tuple)


def _requests(dialect: Dialect) -> dict[Command, st.SearchStrategy[UprEvent]]:
    header = {"opaque": u32, "vbucket": u16}
    item = {"cas": u64, "datatype": u8, **header}
    mutation = dialect.mutation
    stream = dialect.stream_request

    @st.composite
    def removals(draw: st.DrawFn, cls: type[Deletion] | type[Expiration]) -> UprEvent:
        layouts = dialect.deletion if cls is Deletion else dialect.expiration
        layout = draw(st.sampled_from(layouts))
        return cls(
            key=draw(keys),
            by_seqno=draw(u64),
            rev_seqno=draw(u64),
            meta=draw(values) if layout.meta else b"",
            delete_time=draw(u32) if layout.delete_time else None,
            value=draw(values),
            **{name: draw(strategy) for name, strategy in item.items()},
        )

    specific: dict[Command, st.SearchStrategy[UprEvent]] = {
        Command.OPEN: st.builds(Open, name=keys, flags=u32.map(OpenFlags), seqno=u32, **header),
        Command.ADD_STREAM: st.builds(AddStream, flags=u32.map(StreamFlags), **header),
        Command.STREAM_REQ: st.builds(
            StreamRequest,
            flags=u32.map(StreamFlags),
            start_seqno=u64,
            end_seqno=u64,
            vbucket_uuid=u64,
            snap_start_seqno=u64 if stream.snapshot_range else st.just(0),
            snap_end_seqno=u64 if stream.snapshot_range else st.just(0),
            high_seqno=st.just(0) if stream.snapshot_range else u64,
            name=st.binary(max_size=30) if stream.group_id else st.just(b""),
            **header,
        ),
        Command.STREAM_END: st.builds(
            StreamEnd, reason=st.sampled_from(StreamEndReason) | u32, **header
        ),
        Command.SNAPSHOT_MARKER: st.builds(
            SnapshotMarker,
            start_seqno=u64,
            end_seqno=u64,
            flags=u32.map(SnapshotFlags),
            **header,
        ),
        Command.MUTATION: st.builds(
            Mutation,
            key=keys,
            value=values,
            by_seqno=u64,
            rev_seqno=u64,
            flags=u32,
            expiration=u32,
            lock_time=u32,
            nru=u8 if mutation.meta else st.just(0),
            meta=st.binary(max_size=40) if mutation.meta else st.just(b""),
            **item,
        ),
        Command.DELETION: removals(Deletion),
        Command.EXPIRATION: removals(Expiration),
        Command.SET_VBUCKET_STATE: st.builds(
            SetVbucketState, state=st.sampled_from(VBucketState), **header
        ),
        Command.BUFFER_ACKNOWLEDGEMENT: st.builds(
            BufferAcknowledgement, buffer_bytes=u32, **header
        ),
        Command.CONTROL: st.builds(Control, key=keys, value=values, **header),
    }
    return {
        command: (
            specific[command]
            if command in specific
            else st.builds(REQUEST_CLASSES[command], **header)
        )
        for command in dialect.opcodes
    }


# Statuses that decode to a class of their own rather than the generic Response.
_SPECIFIC_STATUSES = {
    (Command.STREAM_REQ, 0x00),
    (Command.STREAM_REQ, 0x23),
    (Command.GET_FAILOVER_LOG, 0x00),
    (Command.ADD_STREAM, 0x00),
}


def _responses(dialect: Dialect) -> list[st.SearchStrategy[UprEvent]]:
    commands = st.sampled_from(sorted(dialect.opcodes))
    out: list[st.SearchStrategy[UprEvent]] = [
        st.builds(Response, command=commands, opaque=u32, status=u16, value=values).filter(
            lambda r: (r.command, r.status) not in _SPECIFIC_STATUSES
        ),
        st.builds(StreamRequestOk, failover_log=failover_logs, opaque=u32),
        st.builds(StreamRequestRollback, rollback_seqno=u64, opaque=u32),
        st.builds(FailoverLogResponse, failover_log=failover_logs, opaque=u32),
    ]
    if Command.ADD_STREAM in dialect.opcodes:
        out.append(st.builds(AddStreamResponse, stream_opaque=u32, opaque=u32, status=u16))
    return out


def events_of(dialect: Dialect) -> st.SearchStrategy[UprEvent]:
    return st.one_of(*_requests(dialect).values(), *_responses(dialect))


EVENTS = {dialect: events_of(dialect) for dialect in DIALECTS}
dialects = st.sampled_from(DIALECTS)


def decode_chunks(chunks: list[bytes], dialect: Dialect) -> list[UprEvent]:
    decoder = UprDecoder(dialect)
    out: list[UprEvent] = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        out.extend(decoder.events())
    assert decoder.buffered == 0
    return out


def test_strategies_cover_every_command_of_each_dialect() -> None:
    for dialect in DIALECTS:
        assert set(_requests(dialect)) == set(dialect.opcodes)


@given(st.data())
def test_round_trip(data: st.DataObject) -> None:
    dialect = data.draw(dialects)
    event = data.draw(EVENTS[dialect])
    assert decode_chunks([encode(event, dialect)], dialect) == [event]


@given(st.data())
def test_any_chunking_yields_the_same_events(data: st.DataObject) -> None:
    dialect = data.draw(dialects)
    batch = data.draw(st.lists(EVENTS[dialect], min_size=1, max_size=8))
    stream = b"".join(encode(event, dialect) for event in batch)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=12)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert decode_chunks(chunks, dialect) == batch


@given(dialects, st.binary(max_size=400))
def test_random_bytes_yield_events_or_protocol_error(dialect: Dialect, blob: bytes) -> None:
    decoder = UprDecoder(dialect, max_frame_size=4096)
    decoder.receive_data(blob)
    for event in drain(decoder, blob):
        assert decode_chunks([encode(event, dialect)], dialect) == [event]


_HEADER = struct.Struct(">BBHBBHIIQ")


@st.composite
def framed_garbage(draw: st.DrawFn) -> bytes:
    """A well-framed packet with a UPR-range opcode and arbitrary contents.

    Extras lengths are mostly ones some message has, so packets get past the
    first check and into the decoders' field handling.
    """
    sizes = st.sampled_from((0, 1, 4, 8, 16, 18, 20, 21, 28, 31, 40, 48))
    extras = draw(sizes.flatmap(lambda n: st.binary(min_size=n, max_size=n)) | st.binary())
    key = draw(st.just(b"") | st.binary(max_size=12))
    value = draw(st.just(b"") | st.binary(max_size=48))
    header = _HEADER.pack(
        draw(st.sampled_from((0x80, 0x81))),
        draw(st.integers(0x4F, 0x5F)),
        len(key),
        len(extras),
        draw(u8),
        draw(st.sampled_from((0, 0x23)) | u16),
        len(extras) + len(key) + len(value),
        draw(u32),
        draw(u64),
    )
    return header + extras + key + value


@given(dialects, st.lists(framed_garbage(), min_size=1, max_size=6))
def test_framed_garbage_decodes_to_events_that_reencode(
    dialect: Dialect, packets: list[bytes]
) -> None:
    # Whatever decodes must encode again (the codec never produces an event
    # its own encoder refuses) and decode to the same event.
    blob = b"".join(packets)
    decoder = UprDecoder(dialect, max_frame_size=4096)
    decoder.receive_data(blob)
    for event in drain(decoder, blob):
        assert decode_chunks([encode(event, dialect)], dialect) == [event]


@given(dialects, st.data(), st.binary(min_size=24, max_size=80))
def test_valid_events_come_out_before_trailing_garbage(
    dialect: Dialect, data: st.DataObject, tail: bytes
) -> None:
    batch = data.draw(st.lists(EVENTS[dialect], min_size=1, max_size=4))
    decoder = UprDecoder(dialect, max_frame_size=4096)
    blob = b"".join(encode(event, dialect) for event in batch) + tail
    decoder.receive_data(blob)
    assert drain(decoder, blob)[: len(batch)] == batch
