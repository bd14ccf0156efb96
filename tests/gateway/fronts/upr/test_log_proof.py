"""Proving a vbucket's log: the meta and segment codecs, torn tails vs damage, starting over."""

from __future__ import annotations

import errno
import io
import random
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.tap import OpaqueCode, TapMutation, TapOpaque
from adapters.translate.log_records import ItemKind, LogItem, LogMark, MarkKind, to_row
from gateway.cli.main import main
from gateway.fronts.upr.checklog import EXIT_NOT_PROVEN, EXIT_PROVEN, EXIT_USAGE
from gateway.fronts.upr.ingest import commit
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.fronts.upr.manifest import MANIFEST_NAME
from gateway.fronts.upr.proof import Meta, prove_vbucket, unpack_meta
from gateway.fronts.upr.segments import frame, scan_bytes, tail_fault
from gateway.fronts.upr.vblog import LogWriteError, VbLog
from gateway.metrics.figures import GatewayStats
from tests.gateway.fronts.upr.test_vblog import NOW, fill

# -- the meta ----------------------------------------------------------------------

metas = st.builds(
    Meta,
    failover=st.lists(
        st.tuples(st.integers(1, 2**48 - 1), st.integers(0, 2**40)), min_size=1, max_size=25
    ),
    reserved=st.integers(0, 2**60),
    purge_seqno=st.integers(0, 2**40),
    clean=st.booleans(),
    segments=st.lists(st.integers(1, 2**60), max_size=40),
    refetch=st.booleans(),
    high=st.integers(0, 2**60),
)


@settings(max_examples=200, deadline=None)
@given(meta=metas, data=st.data())
def test_meta_round_trips_and_any_truncation_or_bit_flip_is_caught(
    meta: Meta, data: st.DataObject
) -> None:
    packed = meta.pack()
    assert unpack_meta(packed) == meta
    cut = data.draw(st.integers(0, len(packed) - 1), label="cut")
    try:
        unpack_meta(packed[:cut])
        raise AssertionError(f"a meta cut to {cut} bytes was accepted")
    except ValueError:
        pass
    bit = data.draw(st.integers(0, len(packed) * 8 - 1), label="bit")
    flipped = bytearray(packed)
    flipped[bit // 8] ^= 1 << bit % 8
    try:
        unpack_meta(bytes(flipped))
        raise AssertionError(f"a meta with bit {bit} flipped was accepted")
    except ValueError:
        pass


# -- segments: torn tails and damage ------------------------------------------------

items = st.builds(
    lambda seqno, key, value: to_row(LogItem(seqno, ItemKind.MUTATION, key, value, 1, seqno)),
    st.integers(1, 2**40),
    st.binary(min_size=1, max_size=30),
    st.binary(max_size=200),
)
marks = st.builds(lambda k, v: to_row(LogMark(k, v)), st.sampled_from(MarkKind), st.integers(0, 99))
rows = st.lists(st.one_of(items, marks), min_size=1, max_size=12)


def _judge(data: bytes) -> tuple[int, str | None]:
    """(bytes of whole records, what is wrong after them or None for a clean or torn end)."""
    good = 0
    for _offset, end, _row in scan_bytes(data):
        good = end
    return good, tail_fault(data, good)


@settings(max_examples=300, deadline=None)
@given(rows=rows, data=st.data())
def test_only_an_interrupted_append_is_a_torn_tail(
    rows: list[list[object]], data: st.DataObject
) -> None:
    """segments.tail_fault: a record cut short (or zeros) at the end is torn; a flipped
    bit anywhere, a length field included, is damage and never cut off."""
    records = [frame(r) for r in rows]
    whole = b"".join(records)
    last = len(whole) - len(records[-1])
    cut = data.draw(st.integers(last, len(whole) - 1), label="cut")
    assert _judge(whole[:cut]) == (last, None)  # torn: the last record is cut off
    zeros = data.draw(st.integers(1, 4096), label="zeros")
    assert _judge(whole + bytes(zeros)) == (len(whole), None)  # a crash-extended file
    bit = data.draw(st.integers(0, len(whole) * 8 - 1), label="bit")
    flipped = bytearray(whole)
    flipped[bit // 8] ^= 1 << bit % 8
    good, fault = _judge(bytes(flipped))
    assert good < len(whole) and fault is not None, (bit, good)


# -- opening a damaged log -----------------------------------------------------------


def _log(root: Path, segment_bytes: int = 600) -> VbLog:
    vblog = VbLog(root, 0, segment_bytes=segment_bytes, rng=random.Random(7))
    vblog.open()
    return vblog


def test_a_flip_in_the_active_segment_before_its_last_record_is_damage(tmp_path: Path) -> None:
    vblog = _log(tmp_path, segment_bytes=1 << 20)
    fill(vblog, 3, keys=4)
    vblog.abandon()
    active = vblog.segments[-1].path
    data = bytearray(active.read_bytes())
    data[len(data) // 3] ^= 0x01
    active.write_bytes(bytes(data))
    proof = prove_vbucket(vblog.dir, 0)
    assert [p.kind for p in proof.problems] == ["segment_damaged"]
    assert active.name in proof.problems[0].text and not proof.torn


def test_after_a_clean_close_a_tail_cut_at_a_record_boundary_is_damage(tmp_path: Path) -> None:
    vblog = _log(tmp_path, segment_bytes=1 << 20)
    fill(vblog, 2, keys=4)
    vblog.close()
    active = vblog.segments[-1].path
    data = active.read_bytes()
    offsets = [offset for offset, _end, _row in scan_bytes(data)]
    # The last round's block of items and its checkpoint end gone, cleanly.
    active.write_bytes(data[: offsets[-2]])
    proof = prove_vbucket(vblog.dir, 0)
    assert [p.kind for p in proof.problems] == ["segment_damaged"]
    assert "ends at seqno 4, the clean close recorded 8" in proof.problems[0].text


def test_starting_over_keeps_the_files_and_draws_a_uuid_the_seed_would_not(tmp_path: Path) -> None:
    vblog = _log(tmp_path)
    fill(vblog, 3, keys=4)
    old_uuid, reserved, high = vblog.failover.uuid, vblog.reserved, vblog.high_seqno
    vblog.close()
    sealed = vblog.segments[0].path
    sealed.unlink()
    before = {p.name: p.read_bytes() for p in vblog.dir.iterdir()}
    again = _log(tmp_path)  # the same seed: FailoverLog.add would give the old uuid again
    assert [p.kind for p in again.problems] == ["segment_missing"]
    assert sealed.name in again.problems[0].text
    assert again.set_aside is not None and again.set_aside.parent.name == "set-aside"
    kept = {p.name: p.read_bytes() for p in again.set_aside.iterdir() if p.name != "why.txt"}
    assert kept == before
    assert sealed.name in (again.set_aside / "why.txt").read_text()
    ((uuid, start),) = again.failover.entries
    assert uuid != old_uuid and start >= reserved > high
    assert again.high_seqno == start and again.needs_refetch and not again.continued
    again.close()
    # The pending re-fetch survives a restart, and ends with a whole backfill.
    third = _log(tmp_path)
    assert third.problems == [] and third.needs_refetch and third.failover.uuid == uuid
    third.ingest(TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, vbucket=0), NOW)
    third.ingest(TapOpaque(OpaqueCode.CLOSE_BACKFILL, vbucket=0), NOW)
    assert not third.needs_refetch
    third.close()
    assert not unpack_meta(third.meta_path.read_bytes()).refetch


def test_with_meta_and_manifest_gone_the_segments_still_bound_the_seqnos(tmp_path: Path) -> None:
    logs = LogSet(tmp_path, LogOptions(segment_bytes=600), GatewayStats(), seed=7)
    logs.open_existing()
    fill(logs.ensure(0), 2, keys=5)  # (fill feeds vbucket 0)
    logs.ensure(1)
    high = logs.logs[0].high_seqno
    logs.close()
    (tmp_path / "vb-0000" / "meta.msgpack").unlink()
    (tmp_path / MANIFEST_NAME).unlink()
    again = LogSet(tmp_path, LogOptions(segment_bytes=600), GatewayStats(), seed=7)
    again.open_existing()
    vblog = again.logs[0]
    assert [p.kind for p in vblog.problems] == ["meta_missing"]
    assert vblog.failover.entries[0][1] >= high
    assert again.logs[1].problems == [] and again.logs[1].continued
    assert again.stats.upr_log.logs_set_aside_total == {"meta_missing": 1}
    # Without a manifest a vbucket with no directory cannot be told from a new one:
    # while other vbuckets have logs, it counts as lost and is fetched whole.
    assert again.ensure(2).needs_refetch
    assert again.logs[2].problems[0].kind == "directory_missing"
    again.close()
    third = LogSet(tmp_path, LogOptions(segment_bytes=600), GatewayStats(), seed=7)
    third.open_existing()
    assert all(not v.problems for v in third)  # the rebuilt manifest is whole
    assert third.ensure(3).problems == []  # a vbucket new to the manifest is just new
    third.close()


def test_a_damaged_manifest_is_kept_aside_and_rebuilt(tmp_path: Path) -> None:
    logs = LogSet(tmp_path, LogOptions(), GatewayStats())
    logs.open_existing()
    fill(logs.ensure(0), 1, keys=3)
    logs.close()
    manifest = tmp_path / MANIFEST_NAME
    damaged = manifest.read_bytes()[:-3]
    manifest.write_bytes(damaged)
    again = LogSet(tmp_path, LogOptions(), GatewayStats())
    again.open_existing()
    assert again.logs[0].problems == [] and again.lost_manifest is not None
    aside = list((tmp_path / "set-aside").glob(MANIFEST_NAME + "-*"))
    assert [p.read_bytes() for p in aside] == [damaged]
    again.close()


def test_a_crash_inside_a_compaction_before_the_install_is_proven(tmp_path: Path) -> None:
    """The meta stops listing the segments a compaction will delete before it deletes them;
    a crash before the install leaves them on disk, unlisted, and read."""
    vblog = _log(tmp_path)
    fill(vblog, 6, keys=5)
    everything = vblog.read(0, vblog.high_seqno, 10**6)
    vblog.doomed = {s.path for s in vblog.segments[1:-1]}
    vblog.save_meta()
    vblog.abandon()
    again = _log(tmp_path)
    # Proven; not closed cleanly, so a new failover entry at its proven end.
    assert again.problems == [] and not again.continued
    assert again.read(0, again.high_seqno, 10**6) == everything
    again.close()


class FailingDisk(VbLog):
    """A log whose next fsync fails (EIO), as a dying disk's would."""

    fail_next_sync = False

    def sync(self) -> None:
        if self.fail_next_sync:
            self.fail_next_sync = False
            raise OSError(errno.EIO, "Input/output error")
        super().sync()


async def test_a_failed_fsync_cuts_the_batch_back_and_writes_it_again(tmp_path: Path) -> None:
    vblog = FailingDisk(tmp_path, 0)
    vblog.open()
    fill(vblog, 1, keys=3)
    published = vblog.segments[-1].size
    for i in range(5):
        vblog.ingest(TapMutation(b"x%d" % i, b"v", cas=100 + i, rev_seqno=1), NOW)
    vblog.fail_next_sync = True
    try:
        await commit({0: vblog}, sync=True)
        raise AssertionError("the failed fsync was not reported")
    except LogWriteError as exc:
        assert "fsync failed" in str(exc)
    assert vblog.segments[-1].path.stat().st_size == published  # cut back
    assert vblog.high_seqno == 3  # nothing of the batch published
    vblog.ingest(TapMutation(b"later", b"v", cas=200, rev_seqno=1), NOW)
    await commit({0: vblog}, sync=True)
    items = vblog.read(0, 100, 100)
    assert [i.by_seqno for i in items] == list(range(1, 10))
    assert [i.key for i in items[3:]] == [b"x0", b"x1", b"x2", b"x3", b"x4", b"later"]
    vblog.close()
    again = VbLog(tmp_path, 0)
    again.open()
    assert again.problems == [] and again.read(0, 100, 100) == items
    again.close()


def test_check_log_exit_status_and_report(tmp_path: Path, capsys: object) -> None:
    assert main(["check-log", "--state-dir", str(tmp_path / "nowhere")]) == EXIT_USAGE
    logs = LogSet(tmp_path, LogOptions(), GatewayStats())
    logs.open_existing()
    fill(logs.ensure(0), 1, keys=3)
    logs.ensure(1)
    logs.close()
    out = io.StringIO()
    from gateway.fronts.upr.checklog import check_state_dir

    assert check_state_dir(tmp_path, out) == EXIT_PROVEN
    text = out.getvalue()
    assert "vb 0: proven: 1 segment, last seqno 3" in text and "closed cleanly" in text
    assert "2 vbuckets: 2 proven, 0 not proven" in text
    (tmp_path / "vb-0001" / "meta.msgpack").write_bytes(b"")
    assert main(["check-log", "--state-dir", str(tmp_path)]) == EXIT_NOT_PROVEN
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "vb 1: NOT PROVEN: vb-0001/meta.msgpack damaged: empty file" in printed
    # Read-only: nothing was set aside or changed.
    assert (tmp_path / "vb-0001" / "meta.msgpack").read_bytes() == b""
    assert not (tmp_path / "set-aside").exists()


def test_a_new_state_directory_needs_no_proof() -> None:
    with tempfile.TemporaryDirectory() as root:
        logs = LogSet(Path(root), LogOptions(), GatewayStats())
        logs.open_existing()
        vblog = logs.ensure(5)
        assert vblog.problems == [] and not vblog.needs_refetch and vblog.continued
        logs.close()
