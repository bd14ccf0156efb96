"""Decode throughput: 1M mutations with 100-byte values, as UPR (DCP) and as TAP.

Baseline, measured in the same run over the same bytes: framing alone
(``FrameReader``, no event objects). The ratio shows what building typed
events costs on top of cutting frames. Input is fed in 256 KiB chunks, as a
socket read would deliver it.

    python bench/decode_bench.py [--count N] [--value-size B]
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

from adapters import tap, upr
from adapters.mcbp import FrameReader

CHUNK = 256 * 1024


def build_stream(encode: Callable[[int], bytes], count: int) -> bytes:
    one_block = [encode(i) for i in range(min(count, 10_000))]
    repeats, rest = divmod(count, len(one_block))
    return b"".join(one_block) * repeats + b"".join(one_block[:rest])


def frame_only(data: bytes) -> int:
    reader = FrameReader()
    count = 0
    for start in range(0, len(data), CHUNK):
        reader.receive_data(data[start : start + CHUNK])
        while reader.next_frame() is not None:
            count += 1
    return count


def tap_events(data: bytes) -> int:
    decoder = tap.TapDecoder()
    count = 0
    for start in range(0, len(data), CHUNK):
        decoder.receive_data(data[start : start + CHUNK])
        while decoder.next_event() is not None:
            count += 1
    return count


def upr_events(data: bytes) -> int:
    decoder = upr.UprDecoder()
    count = 0
    for start in range(0, len(data), CHUNK):
        decoder.receive_data(data[start : start + CHUNK])
        while decoder.next_event() is not None:
            count += 1
    return count


def measure(label: str, run: Callable[[bytes], int], data: bytes, expected: int) -> float:
    started = time.perf_counter()
    count = run(data)
    elapsed = time.perf_counter() - started
    assert count == expected, (label, count)
    rate = count / elapsed
    print(f"  {label:<24} {rate:>12,.0f} packets/s {len(data) / elapsed / 1e6:>9.1f} MB/s")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--value-size", type=int, default=100)
    args = parser.parse_args()
    value = b"v" * args.value_size

    streams = {
        "UPR (dcp) MUTATION": (
            lambda i: upr.encode(
                upr.Mutation(
                    opaque=1,
                    vbucket=i % 1024,
                    key=b"key-%010d" % i,
                    value=value,
                    by_seqno=i + 1,
                    rev_seqno=1,
                    cas=i,
                    flags=0,
                    expiration=0,
                    lock_time=0,
                )
            ),
            upr_events,
        ),
        "TAP MUTATION": (
            lambda i: tap.encode(
                tap.TapMutation(
                    b"key-%010d" % i, value, vbucket=i % 1024, opaque=i, cas=i, rev_seqno=1, nru=0
                )
            ),
            tap_events,
        ),
    }
    print(
        f"decode of {args.count:,} mutations, {args.value_size}-byte values, "
        f"{CHUNK // 1024} KiB chunks"
    )
    for name, (encode, run) in streams.items():
        data = build_stream(encode, args.count)
        print(f"{name}: {len(data) / 1e6:.1f} MB")
        baseline = measure("framing only (baseline)", frame_only, data, args.count)
        events = measure("typed events", run, data, args.count)
        print(f"  events / baseline: {events / baseline:.2f}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the whole run (inputs included): {peak:.0f} MB")


if __name__ == "__main__":
    main()
