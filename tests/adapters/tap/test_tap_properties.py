"""Property tests of the TAP codec: round trips, arbitrary chunking, random bytes
and well-framed packets of random contents."""

from __future__ import annotations

import dataclasses
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.tap import (
    CheckpointLayout,
    ConnectFlags,
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapConnect,
    TapDecoder,
    TapDelete,
    TapEvent,
    TapFlags,
    TapFlush,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapOpcode,
    TapResponse,
    TapVbucketSet,
    encode,
)
from adapters.tap.constants import VBucketState
from adapters.tap.item_messages import ItemMessages, stored_flags
from tests.support.fuzzing import drain

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
keys = st.binary(min_size=1, max_size=64)
values = st.binary(max_size=300)
tap_flags = u16.map(TapFlags)


@st.composite
def connects(draw: st.DrawFn) -> TapConnect:
    flags = ConnectFlags(draw(st.integers(0, 0x1FF) | u32))  # bits 2.x did not know too
    return TapConnect(
        name=draw(st.binary(max_size=40)),
        connect_flags=flags,
        backfill_date=draw(u64) if flags & ConnectFlags.BACKFILL else None,
        vbuckets=(
            tuple(draw(st.lists(u16, max_size=20))) if flags & ConnectFlags.LIST_VBUCKETS else ()
        ),
        checkpoints=(
            tuple(draw(st.lists(st.tuples(u16, u64), max_size=10)))
            if flags & ConnectFlags.CHECKPOINT
            else ()
        ),
        registered_byte=(draw(st.none() | u8) if flags & ConnectFlags.REGISTERED_CLIENT else None),
        opaque=draw(u32),
    )


@st.composite
def mutations(draw: st.DrawFn) -> TapMutation:
    rev = draw(st.none() | u64)
    return TapMutation(
        key=draw(keys),
        value=draw(values),
        vbucket=draw(u16),
        opaque=draw(u32),
        cas=draw(u64),
        flags=draw(u32),
        expiration=draw(u32),
        rev_seqno=rev,
        nru=None if rev is None else draw(st.none() | u8),
        tap_flags=draw(tap_flags),
        ttl=draw(u8),
        datatype=draw(u8),
    )


def checkpoints(
    cls: type[TapCheckpointStart] | type[TapCheckpointEnd],
) -> st.SearchStrategy[TapEvent]:
    return st.builds(
        cls,
        checkpoint_id=u64,
        vbucket=u16,
        opaque=u32,
        cas=u64,
        tap_flags=tap_flags,
        ttl=u8,
        layout=st.sampled_from(CheckpointLayout),
        engine_specific=st.binary(max_size=16),
    )


events: st.SearchStrategy[TapEvent] = st.one_of(
    connects(),
    mutations(),
    st.builds(
        TapDelete,
        key=keys,
        vbucket=u16,
        opaque=u32,
        cas=u64,
        rev_seqno=st.none() | u64,
        tap_flags=tap_flags,
        ttl=u8,
    ),
    st.builds(TapFlush, vbucket=u16, opaque=u32, tap_flags=tap_flags, ttl=u8),
    st.builds(
        TapOpaque,
        opaque_code=st.sampled_from(OpaqueCode) | u32,
        vbucket=u16,
        opaque=u32,
        tap_flags=tap_flags,
        ttl=u8,
        engine_specific_length=st.just(4) | u16,
    ),
    st.builds(
        TapVbucketSet,
        state=st.sampled_from(VBucketState),
        vbucket=u16,
        opaque=u32,
        tap_flags=tap_flags,
        ttl=u8,
    ),
    checkpoints(TapCheckpointStart),
    checkpoints(TapCheckpointEnd),
    st.builds(
        TapResponse,
        opcode=st.sampled_from(TapOpcode),
        opaque=u32,
        status=u16,
        text=st.binary(max_size=40),
    ),
    st.builds(TapNoop, opaque=u32),
    st.builds(TapNoopResponse, opaque=u32, status=u16),
)


def decode_chunks(chunks: list[bytes]) -> list[TapEvent]:
    decoder = TapDecoder()
    out: list[TapEvent] = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        out.extend(decoder.events())
    assert decoder.buffered == 0
    return out


@given(events)
def test_round_trip(event: TapEvent) -> None:
    assert decode_chunks([encode(event)]) == [event]


@given(st.lists(events, min_size=1, max_size=8), st.data())
def test_any_chunking_yields_the_same_events(batch: list[TapEvent], data: st.DataObject) -> None:
    stream = b"".join(encode(e) for e in batch)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=12)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert decode_chunks(chunks) == batch


@given(st.binary(max_size=400))
def test_random_bytes_yield_events_or_protocol_error(blob: bytes) -> None:
    decoder = TapDecoder(max_frame_size=4096)
    decoder.receive_data(blob)
    # Whatever decoded encodes again, to the same event.
    for event in drain(decoder, blob):
        assert decode_chunks([encode(event)]) == [event]


ITEMS = (TapOpcode.MUTATION, TapOpcode.DELETE)
opcodes = st.sampled_from((*ITEMS, *ITEMS, *TapOpcode, 0x0A))


@st.composite
def framed_garbage(draw: st.DrawFn) -> bytes:
    """A well-framed packet with a TAP opcode (or NOOP) and arbitrary contents.

    Extras are mostly of the lengths TAP messages have (8, 16 with item flags
    and expiration), with a small engine-specific length in their first two
    bytes, so packets get past the framing into the decoders' field handling.
    """
    size = draw(st.sampled_from((8, 16)) | st.integers(0, 24))
    extras = bytearray(draw(st.binary(min_size=size, max_size=size)))
    if size >= 2 and draw(st.integers(0, 3)):
        extras[0:2] = draw(st.integers(0, 9)).to_bytes(2, "big")
    key = draw(st.binary(min_size=1, max_size=20) | st.just(b""))
    value = draw(st.just(b"") | st.binary(max_size=48))
    header = struct.pack(
        ">BBHBBHIIQ",
        draw(st.sampled_from((0x80, 0x80, 0x80, 0x81))),
        draw(opcodes | st.integers(0x3E, 0x49) if draw(st.booleans()) else opcodes),
        len(key),
        len(extras),
        draw(u8),
        draw(u16),
        len(extras) + len(key) + len(value),
        draw(u32),
        draw(u64),
    )
    return header + bytes(extras) + key + value


@settings(max_examples=300)
@given(st.lists(framed_garbage(), min_size=1, max_size=6))
def test_framed_garbage_decodes_to_events_that_reencode(packets: list[bytes]) -> None:
    # Whatever decodes must encode again (the codec never produces an event its
    # own encoder refuses) and decode to the same event; a refusal is a
    # ProtocolError placed in the packet refused, never another exception.
    blob = b"".join(packets)
    decoder = TapDecoder(max_frame_size=4096)
    decoder.receive_data(blob)
    for event in drain(decoder, blob):
        assert decode_chunks([encode(event)]) == [event]


@given(st.lists(events, min_size=1, max_size=4), st.binary(min_size=24, max_size=80))
def test_random_tail_after_valid_events(batch: list[TapEvent], tail: bytes) -> None:
    # Valid events always come out before whatever garbage follows them.
    decoder = TapDecoder(max_frame_size=4096)
    decoder.receive_data(b"".join(encode(e) for e in batch) + b"\x80" + tail)
    got: list[TapEvent] = []
    try:
        while (event := decoder.next_event()) is not None:
            got.append(event)
    except ProtocolError:
        pass
    assert got[: len(batch)] == batch


@given(connects(), st.binary(min_size=1, max_size=30))
def test_bytes_after_the_connect_options_are_ignored(connect: TapConnect, tail: bytes) -> None:
    """ep-engine 2.x ep_engine.cc ``createTapQueue`` reads the options it knows
    from the value and never looks at what is left (data of a later flag, say)."""
    packet = bytearray(encode(connect) + tail)
    struct.pack_into(">I", packet, 8, len(packet) - 24)
    expected = connect
    if connect.connect_flags & ConnectFlags.REGISTERED_CLIENT and connect.registered_byte is None:
        expected = dataclasses.replace(connect, registered_byte=tail[0])
    assert decode_chunks([bytes(packet)]) == [expected]


@given(st.sampled_from(TapOpcode), u16, st.integers(0, 16), u32, u16, st.binary(max_size=40))
def test_acks_with_any_key_and_extras_length_decode(
    opcode: TapOpcode, keylen: int, extlen: int, opaque: int, status: int, text: bytes
) -> None:
    """memcached 2.x daemon/memcached.c ``process_bin_tap_ack``: a TAP response is
    its opaque and status, whatever key and extras lengths its header claims; the
    text a nack carries is its body."""
    packet = struct.pack(
        ">BBHBBHIIQ", 0x81, opcode, keylen, extlen, 0, status, len(text), opaque, 0
    )
    assert decode_chunks([packet + text]) == [TapResponse(opcode, opaque, status, text)]


@dataclasses.dataclass
class _Stored:
    key: bytes
    value: bytes
    flags: int
    cas: int = 1
    rev_seqno: int = 1
    expiration: int = 0
    datatype: int = 0


@given(flags=u32, network_order=st.booleans(), keys_only=st.booleans())
def test_a_receiver_reads_back_the_flags_the_producer_sent(
    flags: int, network_order: bool, keys_only: bool
) -> None:
    """Item flags survive the trip whatever the client chose (ep-engine 2.x
    tapconnection.cc swaps them to host order unless FIX_FLAG_BYTEORDER asked
    for network order, marking those NETWORK_BYTE_ORDER), through the codec too."""
    messages = ItemMessages(keys_only=keys_only, network_byte_order=network_order)
    sent = messages.mutation(_Stored(b"k", b"v", flags), 3, nru=2)
    decoder = TapDecoder()
    decoder.receive_data(encode(sent))
    decoded = decoder.next_event()
    assert isinstance(decoded, TapMutation)
    assert stored_flags(sent) == stored_flags(decoded) == flags
