"""Proving a vbucket's log on start-up, read-only: is everything that was logged still there?

Theory of operation. A vbucket directory (``vb-NNNN``) holds segments and
``meta.msgpack``. ``prove_vbucket`` reads both and either proves the log or
lists what is wrong (``Problem``s); it changes nothing on disk, so
``check-log`` runs it too. The log is proven when:

- ``meta.msgpack`` is whole: a crc-framed msgpack map of the current format
  (a bit flip in it, a truncation, an empty or missing file all fail);
- every segment the meta lists is on disk (the meta is rewritten whenever a
  segment is created, and before a compaction deletes any), so a deleted
  segment, the active one included, is noticed;
- every segment reads whole, with seqnos that only grow, except that the
  last one may end in a torn tail (``segments.tail_fault``: an append a
  crash interrupted, which was never fsynced, so never published or acked).

Segments on disk that the meta does not list are fine: a segment created
just before a crash, or one a compaction had not yet deleted (its header
then says it is covered). A directory the manifest does not list, with
no meta and only empty segments, is a new log a kill interrupted before its
first meta: new, its empty files dropped. ``prove_vbucket`` replays the records of a log
that is not refuted as it reads them (``replay``), so opening reads every
segment once.

After a clean close the meta also records the high seqno, and the log
must end exactly there. What it cannot see: after a crash, a segment cut
exactly at a record boundary (with the meta intact) reads as a shorter
history. Appends only end that way when nothing after them was fsynced,
so nothing after them was published or acked; anything else takes a disk
that loses fsynced data, or a hand that truncates a segment at a record
boundary, and the log would then continue after the cut.

``Meta`` is also where the seqno reservation lives (see ``vblog``).
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgpack

from adapters.translate.log_records import LogItem, LogRecord, from_row
from gateway.fronts.upr.segments import (
    FRAME,
    HEADER_ROW,
    SPARSE_EVERY,
    Segment,
    next_whole_record,
    scan_bytes,
    tail_fault,
)
from gateway.runtime.files import fsync_dir

META_NAME = "meta.msgpack"
META_FORMAT = 2
SET_ASIDE_DIR = "set-aside"
"""Under the state directory: logs that could not be proven, kept as they were."""

KINDS = ("directory_missing", "meta_missing", "meta_damaged", "segment_missing", "segment_damaged")
"""What can be wrong with a log (the metric's ``reason`` label)."""


class Problem(NamedTuple):
    kind: str
    """One of ``KINDS``."""
    text: str
    """One line naming the file and what is wrong with it."""


@dataclass
class Meta:
    failover: list[tuple[int, int]]
    reserved: int
    """No seqno above this has been handed out (written before any is)."""
    purge_seqno: int = 0
    clean: bool = False
    segments: list[int] = field(default_factory=list)
    """First seqnos of the segments that must be on disk."""
    refetch: bool = False
    """The vbucket was set aside and its whole contents are due again from the TAP node."""
    high: int = 0
    """The high seqno published when the log was closed cleanly (0 otherwise)."""

    def pack(self) -> bytes:
        payload: bytes = msgpack.packb(
            {
                "format": META_FORMAT,
                "failover": [list(e) for e in self.failover],
                "reserved": self.reserved,
                "purge_seqno": self.purge_seqno,
                "clean": self.clean,
                "segments": self.segments,
                "refetch": self.refetch,
                "high": self.high,
            },
            use_bin_type=True,
        )
        return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _int(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name)
    if type(value) is not int or value < 0:
        raise ValueError(f"field {name} is {value!r:.40}")
    return value


def _bool(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name)
    if type(value) is not bool:
        raise ValueError(f"field {name} is {value!r:.40}")
    return value


def unpack_meta(data: bytes) -> Meta:
    """The meta in ``data``; ``ValueError`` saying what is wrong with it."""
    if not data:
        raise ValueError("empty file")
    if len(data) < FRAME.size:
        raise ValueError(f"{len(data)} bytes, shorter than its header")
    length, crc = FRAME.unpack_from(data)
    payload = data[FRAME.size :]
    if length != len(payload):
        if data[0] & 0xF0 == 0x80:
            raise ValueError("older format without a checksum or segment list")
        raise ValueError(f"header says {length} bytes, the file holds {len(payload)}")
    if zlib.crc32(payload) != crc:
        raise ValueError("fails its crc")
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except ValueError as exc:
        raise ValueError(f"not msgpack ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != META_FORMAT:
        raise ValueError(f"not a format {META_FORMAT} meta map")
    failover = obj.get("failover")
    if (
        not isinstance(failover, list)
        or not failover
        or not all(
            isinstance(e, list) and len(e) == 2 and all(type(n) is int and n >= 0 for n in e)
            for e in failover
        )
    ):
        raise ValueError(f"field failover is {failover!r:.60}")
    segments = obj.get("segments")
    if not isinstance(segments, list) or not all(type(s) is int and s > 0 for s in segments):
        raise ValueError(f"field segments is {segments!r:.60}")
    return Meta(
        failover=[(u, s) for u, s in failover],
        reserved=_int(obj, "reserved"),
        purge_seqno=_int(obj, "purge_seqno"),
        clean=_bool(obj, "clean"),
        segments=segments,
        refetch=_bool(obj, "refetch"),
        high=_int(obj, "high"),
    )


def read_meta(path: Path) -> tuple[Meta | None, str | None]:
    """(meta, None), or (None, what is wrong): "missing" or "damaged: ..."."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "missing"
    try:
        return unpack_meta(data), None
    except ValueError as exc:
        return None, f"damaged: {exc}"


@dataclass
class VbProof:
    vbucket: int
    dir: Path
    exists: bool = False
    meta: Meta | None = None
    segments: list[Segment] = field(default_factory=list)
    """The segments to serve, each up to its last whole record (torn tails excluded)."""
    problems: list[Problem] = field(default_factory=list)
    torn: list[tuple[Path, int, int]] = field(default_factory=list)
    """(segment, good bytes, file size) of a torn tail to cut off."""
    leftovers: list[Path] = field(default_factory=list)
    """Segments a finished compaction covers (it crashed before deleting them)."""
    strays: list[Path] = field(default_factory=list)
    """Temporary files of an interrupted meta write or compaction."""
    high_seen: int = 0
    """The highest seqno any readable record names, damaged segments included."""

    @property
    def proven(self) -> bool:
        return not self.problems

    @property
    def fresh(self) -> bool:
        """No log at all (a vbucket never seen, or a directory created just before a crash)."""
        return self.proven and self.meta is None and not self.segments

    @property
    def torn_bytes(self) -> int:
        return sum(size - good for _, good, size in self.torn)

    def bound(self) -> tuple[int, set[int]]:
        """(a seqno at or above every one handed out, as far as this log tells; its uuids)."""
        meta = self.meta
        if meta is None:
            return self.high_seen, set()
        seqnos = [meta.reserved, self.high_seen, *(s for _, s in meta.failover)]
        return max(seqnos), {u for u, _ in meta.failover}


def _segment_paths(vbdir: Path) -> list[tuple[int, Path]]:
    out = []
    for path in vbdir.glob("*.seg"):
        if path.stem.isdigit():
            out.append((int(path.stem), path))
    return sorted(out)


class _Reader:
    """Reads a vbucket's segments in order, replaying until the first fault."""

    def __init__(self, proof: VbProof, replay: Callable[[LogRecord], None] | None) -> None:
        self.proof = proof
        self.replay = replay
        self.high = 0
        self.covered = 0

    def segment(self, first: int, path: Path, last: bool) -> None:
        proof = self.proof
        data = path.read_bytes()
        if proof.problems:
            self._seqnos_only(data, 0)
            return
        segment = Segment(path, first)
        good = 0
        fault: str | None = None
        for offset, end, row in scan_bytes(data):
            fault = self._row(segment, offset, row)
            if fault is not None:
                break
            good = end
        else:
            if good < len(data):
                fault = tail_fault(data, good)
                if fault is None and not last:
                    fault = "a sealed segment ends in an unfinished record"
                elif fault is None:
                    proof.torn.append((path, good, len(data)))
        if fault is not None:
            where = f"{path.parent.name}/{path.name}"
            text = f"{where} damaged at offset {good} of {len(data)} bytes: {fault}"
            proof.problems.append(Problem("segment_damaged", text))
            self._seqnos_only(data, good)
            return
        segment.size = good
        proof.segments.append(segment)

    def _row(self, segment: Segment, offset: int, row: list[Any]) -> str | None:
        if row[0] == HEADER_ROW:
            if offset != 0 or len(row) != 2 or type(row[1]) is not int:
                return "a segment header out of place"
            self.covered = max(self.covered, row[1])
            self.proof.high_seen = max(self.proof.high_seen, row[1])
            return None
        try:
            record = from_row(row)
        except ValueError:
            return "record is not a log row"
        if isinstance(record, LogItem):
            seqno = record.by_seqno
            if type(seqno) is not int or seqno <= self.high or seqno < segment.first:
                return f"seqno {seqno!r:.20} out of order after {self.high}"
            if segment.count % SPARSE_EVERY == 0:
                segment.sparse.append((seqno, offset))
            segment.count += 1
            segment.last = self.high = seqno
            self.proof.high_seen = max(self.proof.high_seen, seqno)
        if self.replay is not None:
            self.replay(record)
        return None

    def _seqnos_only(self, data: bytes, start: int) -> None:
        """Past a fault: the highest seqno still readable (whole records, resynced)."""
        proof = self.proof
        at: int | None = start
        while at is not None:
            stop = at
            for _offset, record_end, row in scan_bytes(data[at:], at):
                stop = record_end
                if row[0] == 0 and len(row) > 1 and type(row[1]) is int:
                    proof.high_seen = max(proof.high_seen, row[1])
            at = next_whole_record(data, stop + 1) if stop < len(data) else None


def prove_vbucket(
    vbdir: Path,
    vbucket: int,
    *,
    expected: str | None = None,
    replay: Callable[[LogRecord], None] | None = None,
) -> VbProof:
    """Prove ``vbdir``'s log (read-only).

    ``expected``: why this vbucket must have a log (the state directory's
    manifest lists it, say); a missing or empty directory is then a problem,
    not a new vbucket. ``replay`` gets every record of a log not refuted.
    """
    proof = VbProof(vbucket, vbdir, exists=vbdir.is_dir())
    name = vbdir.name
    if not proof.exists:
        if expected is not None:
            proof.problems.append(Problem("directory_missing", f"{name}/ missing ({expected})"))
        return proof
    paths = _segment_paths(vbdir)
    proof.strays = sorted(p for pattern in ("*.seg.compact", "*.tmp") for p in vbdir.glob(pattern))
    meta, wrong = read_meta(vbdir / META_NAME)
    proof.meta = meta
    if wrong == "missing" and expected is None and all(p.stat().st_size == 0 for _, p in paths):
        # A new log killed between its first segment and its first meta: nothing
        # was published (that needs the meta's reservation), so it is new.
        proof.strays += [p for _, p in paths]
        paths = []
    if wrong == "missing":
        if paths or expected is not None:
            because = f", though {expected}" if not paths and expected else ""
            proof.problems.append(Problem("meta_missing", f"{name}/{META_NAME} missing{because}"))
    elif wrong is not None:
        proof.problems.append(Problem("meta_damaged", f"{name}/{META_NAME} {wrong}"))
    reader = _Reader(proof, None if proof.problems else replay)
    on_disk = set()
    for n, (first, path) in enumerate(paths):
        if reader.covered and first <= reader.covered:
            proof.leftovers.append(path)
            continue
        on_disk.add(first)
        reader.segment(first, path, last=n == len(paths) - 1)
    if meta is not None:
        for first in meta.segments:
            if first not in on_disk and not first <= reader.covered:
                text = f"{name}/{first:020d}.seg missing (listed in {META_NAME})"
                proof.problems.append(Problem("segment_missing", text))
        # After a clean close the meta knows where the log ends: a tail cut at a
        # record boundary shows. (A history that began above its last item ends there.)
        top = max(proof.high_seen, meta.failover[0][1])
        if meta.clean and not proof.problems and top != meta.high and paths:
            where = f"{name}/{paths[-1][1].name}"
            text = f"{where} ends at seqno {top}, the clean close recorded {meta.high}"
            proof.problems.append(Problem("segment_damaged", text))
    return proof


# -- logs set aside ---------------------------------------------------------------


def set_aside_root(root: Path) -> Path:
    return root / SET_ASIDE_DIR


def earlier_set_asides(root: Path, vbucket: int) -> list[Path]:
    """Directories this vbucket's logs were set aside to before, oldest first."""
    base = set_aside_root(root)
    if not base.is_dir():
        return []
    return sorted(p for p in base.glob(f"vb-{vbucket:04d}-*") if p.is_dir())


def set_aside_bound(root: Path, vbucket: int) -> tuple[int, set[int]]:
    """What earlier set-aside logs of ``vbucket`` still tell: (seqno bound, uuids)."""
    bound, uuids = 0, set()
    for path in earlier_set_asides(root, vbucket):
        meta, _ = read_meta(path / META_NAME)
        if meta is not None:
            bound = max(bound, meta.reserved, *(s for _, s in meta.failover))
            uuids |= {u for u, _ in meta.failover}
    return bound, uuids


def set_aside(root: Path, vbdir: Path, why: list[str]) -> Path:
    """Move ``vbdir`` whole into ``root/set-aside/`` (with ``why.txt``); where it went.

    A rename, so nothing is copied or destroyed; the name carries the UTC time.
    """
    base = set_aside_root(root)
    base.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = base / f"{vbdir.name}-{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = base / f"{vbdir.name}-{stamp}-{n}"
    os.rename(vbdir, target)
    (target / "why.txt").write_text("".join(line + "\n" for line in why))
    fsync_dir(target)
    fsync_dir(base)
    fsync_dir(root)
    return target
