"""How fast the reference node streams to a client that only reads.

Starts ``tap-upr-gateway node`` in its own process with N sample items
(100-byte values by default), then reads every vbucket in full:

- over TAP: one CONNECT with backfill from 0 and dump (the node closes when done);
- over UPR: OPEN as producer, one STREAM_REQ per vbucket up to its high seqno.

Baseline in the same run: the same number of frames of the same size sent
by a trivial trio server of pre-encoded bytes over loopback to the same
reading loop, i.e. what the socket and the reader alone allow. Also prints
the node's resident memory with the items loaded and its peak.

    python bench/node_stream_bench.py [--items N] [--value-size B] [--vbuckets V]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from functools import partial

import trio

from adapters import tap, upr
from adapters.mcbp import FrameReader
from gateway.io.connection import PacketConnection
from gateway.io.listen import bound_port

RECEIVE = 256 * 1024


async def read_frames(
    stream: trio.abc.Stream, wanted_opcode: int, stop_opcode: int | None, stops: int
) -> tuple[int, int]:
    """Count frames of ``wanted_opcode`` until ``stops`` frames of ``stop_opcode`` or EOF."""
    reader = FrameReader()
    count = total = ended = 0
    while True:
        data = await stream.receive_some(RECEIVE)
        if not data:
            return count, total
        total += len(data)
        reader.receive_data(data)
        while (frame := reader.next_frame()) is not None:
            if frame.opcode == wanted_opcode:
                count += 1
            elif frame.opcode == stop_opcode:
                ended += 1
                if ended == stops:
                    return count, total


async def tap_dump(port: int) -> tuple[int, int, float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    flags = tap.ConnectFlags.BACKFILL | tap.ConnectFlags.DUMP
    started = time.perf_counter()
    await stream.send_all(tap.encode(tap.TapConnect(b"bench", flags, backfill_date=0)))
    count, total = await read_frames(stream, tap.TapOpcode.MUTATION, None, 0)
    elapsed = time.perf_counter() - started
    await stream.aclose()
    return count, total, elapsed


async def upr_streams(port: int, highs: dict[int, int]) -> tuple[int, int, float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    opcodes = upr.DCP.opcodes
    started = time.perf_counter()
    requests = [upr.encode(upr.Open(name=b"bench", flags=upr.OpenFlags.PRODUCER, opaque=1))]
    for vb, high in highs.items():
        requests.append(
            upr.encode(
                upr.StreamRequest(
                    opaque=1000 + vb,
                    vbucket=vb,
                    start_seqno=0,
                    end_seqno=high,
                    vbucket_uuid=0,
                    snap_start_seqno=0,
                    snap_end_seqno=0,
                )
            )
        )
    await stream.send_all(b"".join(requests))
    count, total = await read_frames(
        stream, opcodes[upr.Command.MUTATION], opcodes[upr.Command.STREAM_END], len(highs)
    )
    elapsed = time.perf_counter() - started
    await stream.aclose()
    return count, total, elapsed


async def raw_baseline(frames: int, frame: bytes) -> tuple[int, int, float]:
    block = frame * 1000

    async def sender(stream: trio.SocketStream) -> None:
        full, rest = divmod(frames, 1000)
        for _ in range(full):
            await stream.send_all(block)
        await stream.send_all(frame * rest)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, sender, 0, host="127.0.0.1"))
        stream = await trio.open_tcp_stream("127.0.0.1", bound_port(listeners))
        started = time.perf_counter()
        count, total = await read_frames(stream, frame[1], None, 0)
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return count, total, elapsed


def memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as handle:
        return {
            line.split(":")[0]: int(line.split()[1])
            for line in handle
            if line.startswith(("VmRSS", "VmHWM"))
        }


def report(label: str, count: int, total: int, elapsed: float) -> float:
    rate = count / elapsed
    print(
        f"  {label:<34} {count:>9,} items in {elapsed:6.2f}s = {rate:>10,.0f} items/s "
        f"{total / elapsed / 1e6:7.1f} MB/s"
    )
    return rate


async def bench(args: argparse.Namespace) -> None:
    command = [
        sys.executable,
        "-m",
        "gateway",
        "node",
        "--listen",
        "127.0.0.1:0",
        "--vbucket-count",
        str(args.vbuckets),
        "--sample-items",
        str(args.items),
        "--value-size",
        str(args.value_size),
        "--max-items",
        str(2 * args.items + 10),
    ]
    loading = time.perf_counter()
    node = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert node.stderr is not None
        port = 0
        for line in node.stderr:
            found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        if not port:
            raise SystemExit("node did not start")
        loaded = memory_kib(node.pid)
        print(
            f"node: {args.items:,} items of {args.value_size} bytes in {args.vbuckets} "
            f"vbuckets, loaded in {time.perf_counter() - loading:.1f}s, "
            f"RSS {loaded['VmRSS'] / 1024:.0f} MiB"
        )
        async with await PacketConnection.connect("127.0.0.1", port) as client:
            stats = await client.stats("vbucket-seqno")
        highs = {
            int(k[3:].split(":")[0]): int(v)
            for k, v in stats.items()
            if k.endswith(":high_seqno") and int(v)
        }
        sample = upr.encode(
            upr.Mutation(
                key=b"sample::000000", value=b"v" * args.value_size, by_seqno=1, rev_seqno=1
            )
        )
        baseline = report(
            "baseline: raw frames over loopback", *await raw_baseline(args.items, sample)
        )
        for label, run in (
            ("TAP backfill+dump", tap_dump(port)),
            ("UPR stream of every vbucket", upr_streams(port, highs)),
        ):
            count, total, elapsed = await run
            if count != args.items:
                print(f"  {label}: got {count} items, expected {args.items}")
            rate = report(label, count, total, elapsed)
            print(f"  {'':<34} {rate / baseline:.2f} of the baseline")
        peak = memory_kib(node.pid)
        print(f"node RSS now {peak['VmRSS'] / 1024:.0f} MiB, peak {peak['VmHWM'] / 1024:.0f} MiB")
    finally:
        node.terminate()
        node.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--value-size", type=int, default=100)
    parser.add_argument("--vbuckets", type=int, default=64)
    trio.run(bench, parser.parse_args())


if __name__ == "__main__":
    main()
