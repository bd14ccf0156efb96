"""Synthetic captures for tests, demos and the benchmark.

``vbucket_history`` makes one vbucket's UPR stream as a 3.0 producer would
send it: every key written once, then a share of them rewritten, deleted or
expired, each phase cut into snapshots (so no key appears twice in a
snapshot), ending with STREAM_END. Arrival times grow with the seqno; the
``delay`` shifts a copy for the other side so latencies are known.
``write_capture`` writes records as one connection's segments.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from pathlib import Path

from gateway.tools.capture.records import CaptureRecord, Kind, digest
from gateway.tools.capture.segments import DEFAULT_MAX_SEGMENT_BYTES, SegmentWriter

_MUT, _DEL, _EXP = int(Kind.MUTATION), int(Kind.DELETION), int(Kind.EXPIRATION)
_SNAP, _END = int(Kind.SNAPSHOT), int(Kind.STREAM_END)
BASE_TIME = 1_700_000_000.0


def vbucket_history(
    vb: int,
    keys: int,
    *,
    seed: int = 0,
    snapshot_items: int = 64,
    rewrite: float = 0.2,
    delete: float = 0.1,
    expire: float = 0.05,
    delay: float = 0.0,
    spacing: float = 1e-5,
) -> list[CaptureRecord]:
    rng = random.Random(seed * 1_000_003 + vb)
    names = [b"key::%04d::%07d" % (vb, i) for i in range(keys)]
    rev = dict.fromkeys(names, 0)
    cas = 1_000_000 * (vb + 1)
    phases: list[list[tuple[bytes, int]]] = [[(k, _MUT) for k in names]]
    rewritten = [k for k in names if rng.random() < rewrite]
    phases.append([(k, _MUT) for k in rewritten])
    gone = []
    for k in names:
        roll = rng.random()
        if roll < delete:
            gone.append((k, _DEL))
        elif roll < delete + expire:
            gone.append((k, _EXP))
    phases.append(gone)
    out: list[CaptureRecord] = []
    seqno = 0
    for phase in phases:
        for start in range(0, len(phase), snapshot_items):
            chunk = phase[start : start + snapshot_items]
            snap = (seqno + 1, seqno + len(chunk))
            at = BASE_TIME + seqno * spacing + delay
            out.append(CaptureRecord(_SNAP, vb, b"", None, None, 0, 0, 0, None, None, *snap, 1, at))
            for key, kind in chunk:
                seqno += 1
                cas += 1
                rev[key] += 1
                live = kind == _MUT
                value = b"value-%d-%d" % (seqno, rev[key]) if live else None
                out.append(
                    CaptureRecord(
                        kind,
                        vb,
                        key,
                        seqno,
                        rev[key],
                        cas,
                        0x01000000 if live else 0,
                        0,
                        digest(value) if value is not None else None,
                        None,
                        *snap,
                        0,
                        BASE_TIME + seqno * spacing + delay,
                    )
                )
    at = BASE_TIME + seqno * spacing + delay
    out.append(CaptureRecord(_END, vb, b"", None, None, 0, 0, 0, None, None, None, None, 0, at))
    return out


def history(
    vbuckets: int, keys_per_vbucket: int, *, seed: int = 0, delay: float = 0.0, **options: float
) -> Iterator[CaptureRecord]:
    for vb in range(vbuckets):
        yield from vbucket_history(vb, keys_per_vbucket, seed=seed, delay=delay, **options)  # type: ignore[arg-type]


def write_capture(
    directory: Path,
    records: Iterable[CaptureRecord],
    *,
    side: str = "upr",
    connection: str = "synthetic",
    max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
    chunk: int = 65536,
    block_records: int = 2048,
) -> int:
    """Write ``records`` as one connection's received segments; how many were written."""
    writer = SegmentWriter(
        directory,
        side=side,
        connection=connection,
        direction="received",
        max_segment_bytes=max_segment_bytes,
        block_records=block_records,
    )
    pending: list[CaptureRecord] = []
    for r in records:
        pending.append(r)
        if len(pending) >= chunk:
            writer.write(pending)
            pending = []
    if pending:
        writer.write(pending)
    writer.close()
    return writer.records_written
