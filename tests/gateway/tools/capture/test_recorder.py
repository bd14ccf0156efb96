"""CaptureRecorder: batches off the loop, bounded buffer, clean close on cancel."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import trio

from gateway.tools.capture import CaptureRecorder, Kind, open_recorder, read_capture


def records_in(directory: Path) -> list[tuple]:
    out: list[tuple] = []
    for _, segment in read_capture(directory):
        assert segment.torn is None
        out.extend(segment.typed())
    return out


async def test_records_reach_disk_in_order_with_markers(tmp_path: Path) -> None:
    async with open_recorder(
        tmp_path, side="upr", connection="node", direction="received", batch_records=7
    ) as recorder:
        recorder.record_marker(3, "snapshot", snapshot=(1, 50), flags=1, arrival=1.0)
        for n in range(1, 51):
            recorder.record_item(
                3,
                b"key%d" % n,
                Kind.MUTATION,
                by_seqno=n,
                rev_seqno=1,
                cas=1000 + n,
                flags=7,
                expiration=0,
                value=b"v%d" % n,
                snapshot=(1, 50),
                arrival=1.0 + n,
            )
            if n % 10 == 0:
                await trio.sleep(0)
    got = records_in(tmp_path)
    assert len(got) == 51
    assert got[0].kind == Kind.SNAPSHOT and (got[0].snap_start, got[0].snap_end) == (1, 50)
    assert [r.by_seqno for r in got[1:]] == list(range(1, 51))
    assert got[5].key == b"key5" and got[5].snap_end == 50 and len(got[5].digest) == 16
    assert recorder.stats()["written"] == 51 and recorder.dropped == 0


async def test_a_stalled_disk_drops_and_counts_but_never_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = CaptureRecorder(
        tmp_path, side="tap", connection="slow", direction="sent", max_buffered=10, batch_records=5
    )
    gate = threading.Event()
    real_write = recorder.writer.write

    def stalled(batch: list) -> None:
        gate.wait(10)
        real_write(batch)

    recorder.writer.write = stalled  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, "gateway.tools.capture.recorder")
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        accepted = 0
        for n in range(100):
            accepted += recorder.record_item(
                0, b"k%d" % n, "mutation", by_seqno=None, rev_seqno=n, cas=n, value=b"", arrival=0
            )
            await trio.sleep(0)  # the writer task may take a batch; its thread stays stuck
        assert recorder.dropped == 100 - accepted > 0
        assert accepted <= 2 * 10  # at most a full batch in the stuck thread and a full buffer
        assert "disk is not keeping up" in caplog.text
        gate.set()
        await recorder.close()
    assert len(records_in(tmp_path)) == accepted == recorder.written


async def test_cancellation_still_flushes_and_closes(tmp_path: Path) -> None:
    recorder = CaptureRecorder(tmp_path, side="upr", connection="c", direction="received")
    with trio.move_on_after(0.05):
        async with trio.open_nursery() as nursery:
            await nursery.start(recorder.run)
            for n in range(1000):
                recorder.record_item(
                    1, b"k", "mutation", by_seqno=n + 1, rev_seqno=n + 1, cas=n, arrival=0
                )
            await trio.sleep_forever()
    assert [r.by_seqno for r in records_in(tmp_path)] == list(range(1, 1001))
    await recorder.close()  # already closed: nothing to do
    assert not recorder.record_marker(1, "stream_end", arrival=0)
    assert recorder.dropped == 1


async def test_close_without_a_writer_task(tmp_path: Path) -> None:
    recorder = CaptureRecorder(tmp_path, side="tap", connection="c", direction="sent")
    recorder.record_marker(2, "checkpoint_start", checkpoint_id=4, arrival=0)
    await recorder.close()
    (record,) = records_in(tmp_path)
    assert record.kind == Kind.CHECKPOINT_START and record.checkpoint_id == 4


async def test_a_failing_disk_is_reported_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "file"
    target.write_text("not a directory")
    async with open_recorder(target, side="tap", connection="c", direction="sent") as recorder:
        recorder.record_marker(0, "backfill_start", arrival=0)
    assert recorder.write_errors >= 1 and recorder.dropped == 1
    assert "cannot write segment" in caplog.text
