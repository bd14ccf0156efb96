"""verify's HTML report of a real disagreeing pair (Spark local mode), rendered by headless
Chromium: the DOM shows the verdict and counts, the per-vbucket chart, the latency chart and
the first mismatching records, with hostile keys only ever as text."""

from __future__ import annotations

import struct
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

# The pipeline extra (pip install -e '.[pipeline]'): without it these tests skip.
pytest.importorskip("pyarrow", reason="needs the pipeline extra")
pytest.importorskip("pyspark", reason="needs the pipeline extra")

from gateway.tools.verify.html import render_html
from tests.support import verify_scene
from tests.support.chromium import CHROMIUM, MISSING, dump_dom, screenshot


class Dom(HTMLParser):
    """Text by element id, SVG shapes, and the rows of tables by their nearest id."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.text_by_id: dict[str, str] = {}
        self.shapes: list[dict[str, str | None]] = []
        self.rows: dict[str, list[list[str]]] = {}
        self._open: list[str] = []
        self._ids: list[tuple[str, int]] = []  # open elements with an id, at their depth
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._nested = 0  # inside a record's state table: part of the outer cell
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.tags.append(tag)
        if tag in ("rect", "line", "meta"):
            if tag != "meta":
                self.shapes.append({"tag": tag, **found})
            return
        self._open.append(tag)
        if found.get("id"):
            self._ids.append((str(found["id"]), len(self._open)))
            self.text_by_id[str(found["id"])] = ""
        if tag == "table" and self._cell is not None:
            self._nested += 1
        elif not self._nested and tag == "tr":
            self._row = []
        elif not self._nested and tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("rect", "line") or tag not in self._open:
            return
        while self._open.pop() != tag:
            pass
        if tag == "table" and self._nested:
            self._nested -= 1
        elif not self._nested and tag in ("td", "th") and self._cell is not None:
            assert self._row is not None
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif not self._nested and tag == "tr" and self._row is not None and self._ids:
            self.rows.setdefault(self._ids[-1][0], []).append(self._row)
            self._row = None
        while self._ids and self._ids[-1][1] > len(self._open):
            self._ids.pop()

    def handle_data(self, data: str) -> None:
        for ident, _ in self._ids:
            self.text_by_id[ident] += data
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def report(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return verify_scene.report(spark, tmp_path_factory.mktemp("verify-scene"))


@pytest.mark.skipif(CHROMIUM is None, reason=MISSING)
async def test_the_html_report_of_a_disagreeing_pair_renders_in_chromium(
    report: dict[str, Any], tmp_path: Path
) -> None:
    page = tmp_path / "report.html"
    page.write_text(render_html(report), encoding="utf-8")
    dom = Dom(await dump_dom(page.as_uri(), budget_ms=500))
    # The verdict and the figures.
    assert dom.text_by_id["verdict"] == "DISAGREE"
    figures = {row[0]: row[1] for row in dom.rows["summary"] if len(row) == 2}
    assert figures["Mismatches"] == str(report["mismatches"]["total"]) == "9"
    assert figures["In flight (past the cut, not a failure)"] == "32"
    assert figures["Vbuckets"] == "16"
    checks = {row[0]: row[1] for row in dom.rows["by-check"][1:]}
    assert checks["extra"] == "2" and checks["delete_kind"] == "1" and checks["value"] == "2"
    # The per-vbucket chart: a red bar per vbucket with a defect, amber per vbucket in flight.
    bars = [s for s in dom.shapes if s.get("class") in ("mismatch", "in-flight")]
    assert [s["fill"] for s in bars].count("#c62828") == 5  # vbuckets 2, 5, 7, 9, 11
    amber = [s for s in bars if s["fill"] == "#f0a000"]
    assert len(amber) == len(verify_scene.IN_FLIGHT_VBUCKETS)
    # Vbucket 4 has the most changes in flight: the tallest bar.
    assert max(float(str(s["height"])) for s in bars) == max(float(str(s["height"])) for s in amber)
    # The latency chart: one bar per non-empty bucket, with the zero line between the sides.
    latency = [s for s in dom.shapes if s.get("class") == "latency"]
    assert len(latency) == len(report["latency"]["histogram"]) > 10
    assert [s for s in dom.shapes if s.get("class") == "zero"]
    assert "p99" in dom.text_by_id["latency"]
    # The first mismatching records: check, vbucket, key, side, detail, left, right.
    records = {(row[0], row[1], row[2]): row for row in dom.rows["mismatches"][1:]}
    markup = verify_scene.MARKUP_KEY.decode()
    binary = "hex:" + verify_scene.BINARY_KEY.hex()
    assert ("extra", "7", markup) in records and ("extra", "9", binary) in records
    assert records[("extra", "7", markup)][5] == "absent"  # the left never had it
    assert ("delete_kind", "11", "key::0011::0000000") in records
    assert {("value", "2"), ("value", "5")} <= {(c, vb) for c, vb, _ in records}
    assert "script" not in dom.tags  # the markup key stayed text
    in_flight = dom.rows["in-flight"][1:]
    assert in_flight and {row[1] for row in in_flight} <= {
        str(vb) for vb in verify_scene.IN_FLIGHT_VBUCKETS
    }
    # And it paints: a screenshot of the page's size.
    shot = tmp_path / "report.png"
    await screenshot(page.as_uri(), shot, size=(1280, 1400), budget_ms=500)
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (1280, 1400)
