"""The Spark job in local mode on generated captures: agreement and injected defects."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The pipeline extra (pip install -e '.[pipeline]'): without it these tests skip.
pytest.importorskip("pyarrow", reason="needs the pipeline extra")
pytest.importorskip("pyspark", reason="needs the pipeline extra")

from gateway.tools.capture import CaptureRecord, Kind
from gateway.tools.capture.segments import encode_block
from gateway.tools.verify.command import add_verify_parser
from gateway.tools.verify.job import VerifyConfig, run_verify
from gateway.tools.verify.synthetic import history, vbucket_history, write_capture

VBUCKETS = 4
KEYS = 60


def records() -> list[CaptureRecord]:
    return list(history(VBUCKETS, KEYS, snapshot_items=16))


def write_pair(tmp_path: Path, right: list[CaptureRecord]) -> tuple[str, str]:
    left_dir, right_dir = tmp_path / "left", tmp_path / "right"
    write_capture(left_dir, records(), max_segment_bytes=4096, block_records=32)
    write_capture(right_dir, right, max_segment_bytes=4096, block_records=32)
    return str(left_dir), str(right_dir)


def verify(spark: Any, left: str, right: str, **options: Any) -> dict[str, Any]:
    config = VerifyConfig(left, right, partitions=4, progress=False, **options)
    return run_verify(config, spark).report


def found(report: dict[str, Any]) -> set[tuple[str, int, str]]:
    return {(s["check"], s["vbucket"], s["key"]) for s in report["mismatches"]["samples"]}


def test_identical_sides_agree(spark: Any, tmp_path: Path) -> None:
    shifted = [r._replace(arrival=r.arrival + 0.004) for r in records()]
    report = verify(spark, *write_pair(tmp_path, shifted))
    assert report["agree"] and report["mismatches"]["total"] == 0
    assert report["vbuckets"] == VBUCKETS and report["keys"] == VBUCKETS * KEYS
    assert report["records"]["left"] == report["records"]["right"] == len(records())
    assert report["segments"]["left"] > 1  # several partitions per side
    assert report["latency"]["count"] == report["items"]["left"]
    assert report["latency"]["p50_s"] == pytest.approx(0.004, rel=0.13)
    (bucket,) = report["latency"]["histogram"]  # every version 4 ms late: one bucket
    assert bucket["count"] == report["latency"]["count"]
    assert bucket["low_s"] <= 0.004 <= bucket["high_s"]
    assert report["mismatches"]["by_vbucket"] == {}


def _edit(
    match: Callable[[CaptureRecord], bool], change: Callable[[list[CaptureRecord], int], None]
) -> list[CaptureRecord]:
    rs = records()
    index = next(i for i, r in enumerate(rs) if match(r))
    change(rs, index)
    return rs


def is_item(vb: int, key: bytes, kind: int | None = None) -> Callable[[CaptureRecord], bool]:
    return lambda r: r.vbucket == vb and r.key == key and (kind is None or r.kind == kind)


def key(vb: int, n: int) -> bytes:
    return b"key::%04d::%07d" % (vb, n)


def last_mutation(vb: int) -> CaptureRecord:
    """A key whose last event is a mutation (so dropping it changes the final state)."""
    rs = vbucket_history(vb, KEYS, snapshot_items=16)
    last: dict[bytes, CaptureRecord] = {}
    for r in rs:
        if r.kind < 10:
            last[r.key] = r
    return next(r for r in last.values() if r.kind == Kind.MUTATION and r.rev_seqno == 2)


def test_dropped_mutation(spark: Any, tmp_path: Path) -> None:
    victim = last_mutation(2)
    rs = [r for r in records() if r != victim]
    report = verify(spark, *write_pair(tmp_path, rs))
    assert not report["agree"]
    text = victim.key.decode()
    assert ("metadata", 2, text) in found(report) and ("value", 2, text) in found(report)
    # Nothing else (the snapshot it was in may end early on the right, if it was last).
    assert set(report["mismatches"]["by_check_and_side"]) <= {"metadata", "value", "snapshot"}
    assert report["mismatches"]["by_check"]["metadata"] == 1
    assert report["mismatches"]["by_vbucket"] == {"2": report["mismatches"]["total"]}


def test_extra_key(spark: Any, tmp_path: Path) -> None:
    def add(rs: list[CaptureRecord], i: int) -> None:
        rs.insert(i + 1, rs[i]._replace(key=b"intruder", by_seqno=rs[i].by_seqno))

    rs = _edit(is_item(1, key(1, 5)), add)
    report = verify(spark, *write_pair(tmp_path, rs))
    assert ("extra", 1, "intruder") in found(report)
    assert report["mismatches"]["by_check"]["extra"] == 1


def test_delete_recorded_as_expiration(spark: Any, tmp_path: Path) -> None:
    rs = records()
    index = next(i for i, r in enumerate(rs) if r.kind == Kind.DELETION and r.vbucket == 3)
    victim = rs[index]
    rs[index] = victim._replace(kind=int(Kind.EXPIRATION))
    report = verify(spark, *write_pair(tmp_path, rs))
    assert found(report) == {("delete_kind", 3, victim.key.decode())}
    assert report["mismatches"]["total"] == 1


def test_swapped_order(spark: Any, tmp_path: Path) -> None:
    rs = records()
    i = next(i for i, r in enumerate(rs) if r.vbucket == 0 and r.kind == Kind.MUTATION)
    rs[i], rs[i + 1] = rs[i + 1], rs[i]
    report = verify(spark, *write_pair(tmp_path, rs))
    assert ("seqno_order", 0, rs[i + 1].key.decode()) in found(report)
    assert set(report["mismatches"]["by_check_and_side"]) == {"seqno_order"}


def test_changed_value(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = last_mutation(1)
    rs = [r._replace(digest=b"\x00" * 16) if r == victim else r for r in records()]
    left, right = write_pair(tmp_path, rs)
    parser = add_verify_parser(__import__("argparse").ArgumentParser().add_subparsers())
    args = parser.parse_args(
        [
            left,
            right,
            "--report",
            str(tmp_path / "r.json"),
            "--html",
            str(tmp_path / "r.html"),
            "--mismatches",
            str(tmp_path / "bad"),
            "--partitions",
            "4",
            "--no-progress",
        ]
    )
    assert args.handler(args, spark) == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert found(report) == {("value", 1, victim.key.decode())}
    sample = report["mismatches"]["samples"][0]
    assert (
        sample["right"]["digest"] == "00" * 16
        and sample["left"]["digest"] != sample["right"]["digest"]
    )
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert 'id="verdict">DISAGREE<' in page and f"<code>{victim.key.decode()}</code>" in page
    out = capsys.readouterr().out
    assert out.startswith("DISAGREE") and "value: 1 (both 1)" in out
    bad = spark.read.parquet(str(tmp_path / "bad")).collect()
    assert [(r.check, r.vbucket, r.key) for r in bad] == [("value", 1, victim.key)]


def test_torn_and_damaged_segments(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    left, right = write_pair(tmp_path, records())
    last = sorted(Path(right).iterdir())[-1]
    data = last.read_bytes()
    last.write_bytes(data[:-3])  # the STREAM_END of the last vbucket is torn off
    report = verify(spark, left, right)
    (diag,) = report["diagnostics"]
    assert diag["kind"] == "torn" and diag["side"] == "right" and last.name in diag["file"]
    assert "torn last block" in diag["detail"]
    # A damaged block before the end: the command says which file and exits 2.
    first = sorted(Path(right).iterdir())[0]
    raw = bytearray(first.read_bytes())
    raw[-40] ^= 0xFF
    first.write_bytes(bytes(raw) + encode_block([]))
    parser = add_verify_parser(__import__("argparse").ArgumentParser().add_subparsers())
    args = parser.parse_args([left, right, "--partitions", "4", "--no-progress"])
    assert args.handler(args, spark) == 2
    captured = capsys.readouterr()
    assert "damaged segment" in captured.out and first.name in captured.out
    assert "checksum" in captured.out


def test_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = add_verify_parser(__import__("argparse").ArgumentParser().add_subparsers())
    (tmp_path / "empty").mkdir()
    for left, message in (
        (tmp_path / "nowhere", "no such capture directory"),
        (tmp_path / "empty", "no capture segments"),
    ):
        args = parser.parse_args([str(left), str(tmp_path), "--no-progress"])
        assert args.handler(args) == 2
        assert message in capsys.readouterr().err
