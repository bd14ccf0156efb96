"""Compaction while the newest versions of keys are published but not yet synced.

Compaction keeps, of each key, the version the index names as its latest. With
fsync batch that version may be written and served but not synced; if the
older version (synced, and acked to the TAP node) is compacted away and a
power loss then takes the newer one, the log no longer holds the key at all
until the node sends the newer version again: an acknowledged version gone
from the log. So while the active segment has unsynced records, a version
there does not replace an older one in compaction.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.tap import TapMutation
from adapters.tap.constants import TapFlags
from adapters.translate.log_records import LogItem
from gateway.fronts.upr.compaction import CompactionError, compact_log
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.fronts.upr.vblog import VbLog
from gateway.metrics.figures import GatewayStats

NOW = 1_700_000_000.0


def feed(vblog: VbLog, start: int, n: int, value: bytes) -> None:
    for k in range(n):
        message = TapMutation(b"k%d" % k, value, cas=start + k, rev_seqno=start + k,
                              tap_flags=TapFlags.NETWORK_BYTE_ORDER)  # fmt: skip
        vblog.ingest(message, NOW)


async def test_compaction_keeps_an_acked_version_whose_successor_is_not_synced(
    tmp_path: Path,
) -> None:
    vblog = VbLog(tmp_path, 0, segment_bytes=300, tail_bytes=1)
    vblog.open()
    for r in range(4):  # synced (so acked) versions, across sealed segments
        feed(vblog, 1 + 10 * r, 5, b"synced-%d" % r)
        vblog.write()
        vblog.sync()
        vblog.publish()
    assert len(vblog.segments) > 1
    acked = {k: v[0] for k, v in vblog.translator.index.items()}  # (seqno, ...)
    feed(vblog, 100, 5, b"served")  # newer versions: written and served, fsync pending
    assert vblog.write_early() > 0
    synced_size = vblog.written_size - len(vblog.file.written)  # what the last fsync covered
    await compact_log(vblog, NOW + 10, purge_interval=3600)
    path = vblog.segments[-1].path
    vblog.abandon()
    with open(path, "r+b") as f:  # power loss: the unsynced bytes never reached the disk
        f.truncate(synced_size)
    again = VbLog(tmp_path, 0)
    again.open()
    # Every key keeps a version at least as new as the one acked.
    for key, seqno in acked.items():
        version = again.translator.version(key)
        assert version is not None and version.seqno >= seqno, key
    again.close()


async def test_a_compaction_the_disk_refuses_leaves_the_log_as_it_was(tmp_path: Path) -> None:
    """Found by the chaos runs: a compaction's write failing (EFBIG under a file-size
    limit) escaped the compaction loop and stopped ``serve`` (exit 1, no path named).
    The new segment cannot be created here (its name is taken by a directory), as a
    full disk or a file-size limit refuses it."""
    vblog = VbLog(tmp_path, 0, segment_bytes=300, tail_bytes=1)
    vblog.open()
    for r in range(4):
        feed(vblog, 1 + 10 * r, 5, b"v%d" % r)
        vblog.write()
        vblog.sync()
        vblog.publish()
    segments = [s.path for s in vblog.segments]
    before = [(i.by_seqno, i.key, i.value) for i in vblog.read(0, 10**6, 10**9)]
    blocker = segments[0].with_name(segments[0].name + ".compact")
    blocker.mkdir()
    said = r"vbucket 0: compaction skipped: cannot write vb-0000/\d+\.seg\.compact: .*stay as"
    with pytest.raises(CompactionError, match=said):
        await compact_log(vblog, NOW + 10, purge_interval=3600)
    assert [s.path for s in vblog.segments] == segments and all(p.exists() for p in segments)
    assert [(i.by_seqno, i.key, i.value) for i in vblog.read(0, 10**6, 10**9)] == before
    blocker.rmdir()  # room again: the next round compacts
    assert await compact_log(vblog, NOW + 10, purge_interval=3600) > 0
    vblog.close()
    again = VbLog(tmp_path, 0)
    again.open()
    assert not again.problems
    latest = {key: value for _, key, value in before}
    assert {i.key: i.value for i in again.read(0, 10**6, 10**9)} == latest
    again.close()


def test_a_log_started_over_and_closed_empty_goes_on_from_its_new_history(
    tmp_path: Path,
) -> None:
    """Found by the chaos runs: a log set aside at start-up (a damaged sealed segment)
    starts over with a history above every seqno it handed out; closed cleanly before
    the re-fetch brought anything, it reopened with its next seqno 1, so consumers that
    rolled back to 0 were served seqnos 1, 2, ... again under the new uuid, as other
    items (by_seqnos are never reused: README), and its segment named 100006 held seqno
    1 (the next start found it out of order and set the log aside again)."""
    vblog = VbLog(tmp_path, 0, segment_bytes=300, tail_bytes=1)
    vblog.open()
    for r in range(3):
        feed(vblog, 1 + 10 * r, 5, b"v%d" % r)
        vblog.write()
        vblog.sync()
        vblog.publish()
    handed_out = vblog.high_seqno
    first = vblog.segments[0].path
    vblog.close()
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0x40  # a sealed segment damaged while the gateway was down
    first.write_bytes(bytes(data))
    logs = LogSet(tmp_path, LogOptions(), GatewayStats())
    logs.open_existing()
    started = logs.logs[0]
    assert started.set_aside is not None
    start = started.translator.high_seqno
    assert start > handed_out
    logs.close()  # cleanly, before the re-fetch brought anything
    again = LogSet(tmp_path, LogOptions(), GatewayStats())
    again.open_existing()
    vb = again.logs[0]
    assert not vb.problems
    records = vb.ingest(TapMutation(b"new", b"x", cas=99, rev_seqno=1,
                                    tap_flags=TapFlags.NETWORK_BYTE_ORDER), NOW)  # fmt: skip
    seqnos = [r.by_seqno for r in records if isinstance(r, LogItem)]
    assert seqnos and min(seqnos) > start, (seqnos, start)
    again.abandon()
