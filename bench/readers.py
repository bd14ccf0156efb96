"""Clients of the benchmarks: they read as fast as they can and count.

``tap_read`` is a TAP client (CONNECT with backfill+dump or live, support-ack,
and with ``checkpoint`` the CHECKPOINT flag, so live items come in checkpoints):
it acks every message that asks for one, as a 2.x consumer does, counts the
mutations and, for live items, records now - the send time in the value.
``upr_read`` is a UPR consumer of every vbucket up to its high seqno (or
open-ended for live items), returning flow-control bytes as it reads.
"""

from __future__ import annotations

import struct
import time

import trio
from inmem import LIVE_VALUE, STAMP

from adapters import tap, upr
from adapters.mcbp import FrameReader

RECEIVE = 256 * 1024
_TAP_MUTATION = tap.TapOpcode.MUTATION.value
_TAP_ACK = tap.TapFlags.ACK.value
_TAP_FLAGS = struct.Struct(">H")
_UPR_MUTATION = upr.DCP.opcodes[upr.Command.MUTATION]
_UPR_STREAM_END = upr.DCP.opcodes[upr.Command.STREAM_END]


def _latency(value: bytes, now: float, out: list[float] | None) -> None:
    if out is not None:
        out.append(now - STAMP.unpack_from(value)[0])


async def tap_read(
    port: int,
    *,
    name: bytes,
    dump: bool,
    expected: int | None = None,
    latencies: list[float] | None = None,
    checkpoint: bool = False,
) -> tuple[int, int, float]:
    """(mutations, bytes, seconds) of one TAP stream through ``port``."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    flags = tap.ConnectFlags.SUPPORT_ACK
    if dump:
        flags |= tap.ConnectFlags.BACKFILL | tap.ConnectFlags.DUMP
    if checkpoint:
        flags |= tap.ConnectFlags.CHECKPOINT
    reader = FrameReader(lenient_responses=True)
    count = total = 0
    started = time.perf_counter()
    await stream.send_all(tap.encode(tap.TapConnect(name, flags, backfill_date=0)))
    while expected is None or count < expected:
        data = await stream.receive_some(RECEIVE)
        if not data:
            break
        now = time.time()
        total += len(data)
        reader.receive_data(data)
        acks = []
        while (frame := reader.next_frame()) is not None:
            if frame.opcode == _TAP_MUTATION:
                count += 1
                if latencies is not None:
                    _latency(frame.body[-LIVE_VALUE:], now, latencies)
            asks = frame.is_request and len(frame.body) >= 4
            if asks and _TAP_FLAGS.unpack_from(frame.body, 2)[0] & _TAP_ACK:
                acks.append(tap.encode(tap.TapResponse(tap.TapOpcode(frame.opcode), frame.opaque)))
        if acks:
            await stream.send_all(b"".join(acks))
    elapsed = time.perf_counter() - started
    await stream.aclose()
    return count, total, elapsed


async def upr_read(
    port: int,
    highs: dict[int, int],
    *,
    name: bytes,
    live: bool = False,
    expected: int | None = None,
    latencies: list[float] | None = None,
    buffer_size: int = 8 * 1024 * 1024,
) -> tuple[int, int, float]:
    """(mutations, bytes, seconds) of every vbucket's UPR stream through ``port``."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    started = time.perf_counter()
    requests = [
        upr.encode(upr.Open(name=name, flags=upr.OpenFlags.PRODUCER, opaque=1)),
        upr.encode(upr.Control(b"connection_buffer_size", b"%d" % buffer_size, opaque=2)),
    ]
    for vb, high in highs.items():
        requests.append(
            upr.encode(
                upr.StreamRequest(
                    opaque=1000 + vb, vbucket=vb,
                    start_seqno=high if live else 0,
                    end_seqno=(1 << 64) - 1 if live else high,
                    vbucket_uuid=0, snap_start_seqno=high if live else 0,
                    snap_end_seqno=high if live else 0,
                )
            )
        )  # fmt: skip
    await stream.send_all(b"".join(requests))
    reader = FrameReader()
    count = total = ended = 0
    unacked = 0
    wanted_ends = 0 if live else sum(1 for high in highs.values() if high)
    while True:
        data = await stream.receive_some(RECEIVE)
        if not data:
            break
        now = time.time()
        total += len(data)
        reader.receive_data(data)
        while (frame := reader.next_frame()) is not None:
            if frame.is_request:
                unacked += frame.size
            if frame.opcode == _UPR_MUTATION:
                count += 1
                if latencies is not None:
                    _latency(frame.value, now, latencies)
            elif frame.opcode == _UPR_STREAM_END:
                ended += 1
        if unacked >= buffer_size // 4:
            await stream.send_all(upr.encode(upr.BufferAcknowledgement(unacked, opaque=3)))
            unacked = 0
        if (not live and ended >= wanted_ends) or (expected is not None and count >= expected):
            break
    elapsed = time.perf_counter() - started
    await stream.aclose()
    return count, total, elapsed
