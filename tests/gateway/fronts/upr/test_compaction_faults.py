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

from adapters.tap import TapMutation
from adapters.tap.constants import TapFlags
from gateway.fronts.upr.compaction import compact_log
from gateway.fronts.upr.vblog import VbLog

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
