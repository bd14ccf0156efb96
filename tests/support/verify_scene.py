"""Two captures with something to show: the pair the HTML report test and
``scripts/verify-report-screenshot`` verify.

Both sides hold the same synthetic UPR history of 16 vbuckets, each cut
(CUT records) at one CAS; the right side arrives later by a spread of
latencies (a few versions earlier than the left). In some vbuckets the left
side recorded changes past the cut that the right never reached (in flight,
not a failure); inside the cut the right side has real defects: a dropped
mutation, a wrong value, a deletion recorded as an expiration, and two keys
the left never had, one of them markup and one not UTF-8.

Run as a program it writes a screenshot of the report:
``python -m tests.support.verify_scene docs/verify-report.png``.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.tools.capture.records import CaptureRecord, Kind, cut_record
from gateway.tools.verify.synthetic import vbucket_history, write_capture

VBUCKETS = 16
KEYS = 120
IN_FLIGHT_VBUCKETS = {1: 6, 4: 14, 8: 3, 12: 9}
"""vbucket -> how many of the left's last changes lie past the cut."""
MARKUP_KEY = b"<script>alert('key')</script>"
BINARY_KEY = b"\xff\xfe-not-utf8"
_MUT, _DEL, _EXP = int(Kind.MUTATION), int(Kind.DELETION), int(Kind.EXPIRATION)
_SNAP, _END = int(Kind.SNAPSHOT), int(Kind.STREAM_END)


def _items(records: list[CaptureRecord]) -> list[int]:
    return [i for i, r in enumerate(records) if r.kind in (_MUT, _DEL, _EXP)]


def _sides(vb: int, rng: random.Random) -> tuple[list[CaptureRecord], list[CaptureRecord]]:
    left = vbucket_history(vb, KEYS, snapshot_items=32)
    items = _items(left)
    past = IN_FLIGHT_VBUCKETS.get(vb, 0)
    cut_at = left[items[-1 - past]]
    cut = cut_record(vb, cas=cut_at.cas, seqno=cut_at.by_seqno or 0, arrival=left[-1].arrival)
    right = []
    for r in left:
        if past and (
            (r.kind in (_MUT, _DEL, _EXP) and r.cas > cut.cas)
            or (r.kind == _SNAP and (r.snap_start or 0) > (cut.by_seqno or 0))
            or r.kind == _END
        ):
            continue  # the right stopped at the cut, still streaming
        # Most versions reach the right 1-10 ms later; a few the right had first.
        late = rng.lognormvariate(-5.8, 0.5) if rng.random() > 0.03 else -rng.uniform(1e-4, 1e-3)
        right.append(r._replace(arrival=r.arrival + late))
    return [*left, cut], [*right, cut]


def _defects(vb: int, right: list[CaptureRecord]) -> None:
    """Real differences inside the cut, on the right side."""
    items = _items(right)
    if vb == 2:  # a dropped mutation: the key's last version is missing
        last = {right[i].key: i for i in items}
        victim = next(
            i for i in reversed(items) if right[i].kind == _MUT and last[right[i].key] == i
        )
        del right[victim]
    elif vb == 5:  # a wrong value
        i = next(i for i in reversed(items) if right[i].kind == _MUT)
        right[i] = right[i]._replace(digest=b"\x00" * 16)
    elif vb == 11:  # a deletion recorded as an expiration
        i = next(i for i in items if right[i].kind == _DEL)
        right[i] = right[i]._replace(kind=_EXP)
    elif vb in (7, 9):  # keys the left never had
        i = items[len(items) // 2]
        key = MARKUP_KEY if vb == 7 else BINARY_KEY
        right.insert(i + 1, right[i]._replace(key=key, rev_seqno=1))


def write_pair(directory: Path) -> tuple[str, str]:
    """The two capture directories (left: TAP-like reference, right: with defects)."""
    rng = random.Random(13)
    lefts, rights = [], []
    for vb in range(VBUCKETS):
        left, right = _sides(vb, rng)
        _defects(vb, right)
        lefts += left
        rights += right
    paths = directory / "left", directory / "right"
    write_capture(paths[0], lefts, max_segment_bytes=1 << 16)
    write_capture(paths[1], rights, max_segment_bytes=1 << 16)
    return str(paths[0]), str(paths[1])


def report(spark: Any, directory: Path) -> dict[str, Any]:
    from gateway.tools.verify.job import VerifyConfig, run_verify

    left, right = write_pair(directory)
    return run_verify(VerifyConfig(left, right, partitions=4, progress=False), spark).report


def main(out: Path) -> None:
    import trio

    from gateway.tools.verify.html import render_html
    from gateway.tools.verify.job import spark_session
    from tests.support.chromium import screenshot

    out = out.resolve()
    with tempfile.TemporaryDirectory(prefix="verify-scene-") as tmp:
        os.chdir(tmp)  # before Spark starts, so the report names cap/left and cap/right
        spark = spark_session("local[2]", app_name="verify report screenshot", driver_memory="1g")
        try:
            page = Path(tmp) / "report.html"
            page.write_text(render_html(report(spark, Path("cap"))), encoding="utf-8")
        finally:
            spark.stop()
        trio.run(lambda: screenshot(page.as_uri(), out, size=(1280, 1400)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/verify-report.png"))
