"""The HTML report builder (gateway.tools.verify.html): any report renders, every value from the
data is only ever text, and the page holds the summary, the charts and the first records."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gateway.tools.verify.html import FIRST_RECORDS, render_html

ALLOWED_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "span", "b", "section",
    "div", "table", "thead", "tbody", "tr", "th", "td", "code", "ul", "li", "svg", "g", "rect",
    "line", "text",
}  # fmt: skip
ALLOWED_ATTRIBUTES = {
    "lang", "charset", "name", "content", "class", "id", "title", "style", "role", "aria-label",
    "xmlns", "width", "height", "viewbox", "x", "y", "x1", "x2", "y1", "y2", "fill", "stroke",
    "text-anchor", "data-vbucket", "stroke-dasharray",
}  # fmt: skip
VOID = {"meta"}
FETCHING = {"src", "srcset", "href", "xlink:href", "action", "formaction", "poster", "data",
            "background", "ping"}  # fmt: skip
"""Attributes with which a browser would load a URL."""

HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "</td></tr></table></body>",
    "' onmouseover='x",
    "&amp; &lt;",
    "]]><!--",
    "\x00\x1b[31m\u2028\ud800",
    "hex:3c21",
    "http://",
]


class Page(HTMLParser):
    """The tags, attributes and text of a page, checking that elements nest."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attributes: set[str] = set()
        self.values: list[str] = []
        self.text: list[str] = []
        self.open: list[str] = []
        self.ids: dict[str, str] = {}
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._tag(tag, attrs)
        if tag not in VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._tag(tag, attrs)

    def _tag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes |= {name for name, _ in attrs}
        self.values += [value for _, value in attrs if value is not None]
        for name, value in attrs:
            if name == "id" and value is not None:
                self.ids[value] = tag

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


texts = st.one_of(st.sampled_from(HOSTILE), st.text(st.characters(codec=None), max_size=20))
numbers = st.one_of(
    st.none(), st.integers(-(2**64), 2**64), st.floats(allow_nan=True), texts, st.booleans()
)
counts = st.integers(0, 10**9)
states = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {
            "kind": texts,
            "by_seqno": numbers,
            "rev_seqno": numbers,
            "cas": numbers,
            "flags": numbers,
            "expiration": numbers,
            "digest": st.one_of(st.none(), texts),
        }
    ),
)
samples = st.lists(
    st.fixed_dictionaries(
        {
            "check": texts,
            "vbucket": numbers,
            "key": texts,
            "side": texts,
            "detail": texts,
            "left": states,
            "right": states,
        }
    ),
    max_size=8,
)
by_vbucket = st.dictionaries(st.one_of(st.integers(0, 1023).map(str), texts), numbers, max_size=30)
buckets = st.lists(
    st.fixed_dictionaries({"low_s": numbers, "high_s": numbers, "count": numbers}), max_size=40
)


@st.composite
def reports(draw: st.DrawFn) -> dict[str, Any]:
    report = {
        "left": draw(texts),
        "right": draw(texts),
        "agree": draw(st.one_of(st.booleans(), numbers)),
        "master": draw(texts),
        "segments": {"left": draw(numbers), "right": draw(numbers)},
        "records": {"left": draw(numbers), "right": draw(numbers)},
        "items": {"left": draw(counts), "right": draw(counts)},
        "keys": draw(numbers),
        "vbuckets": draw(numbers),
        "mismatches": {
            "total": draw(numbers),
            "by_check": draw(st.dictionaries(texts, numbers, max_size=5)),
            "by_check_and_side": draw(
                st.dictionaries(texts, st.dictionaries(texts, numbers, max_size=3), max_size=5)
            ),
            "by_vbucket": draw(by_vbucket),
            "samples": draw(samples),
        },
        "in_flight": {"total": draw(numbers), "by_vbucket": draw(by_vbucket), "samples": []},
        "latency": {
            "count": draw(st.one_of(counts, numbers)),
            "p50_s": draw(numbers),
            "p99_s": draw(numbers),
            "histogram": draw(buckets),
        },
        "diagnostics": draw(
            st.lists(st.fixed_dictionaries({"kind": texts, "side": texts, "file": texts}))
        ),
        "timing": {"total_s": draw(numbers)},
    }
    # Reports of other versions: any section may be missing.
    for name in draw(st.lists(st.sampled_from(sorted(report)), max_size=4)):
        report.pop(name, None)
    return report


def data_strings(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    mism = report.get("mismatches", {})
    for sample in mism.get("samples", []):
        out += [sample["key"], sample["detail"], sample["check"]]
    for diag in report.get("diagnostics", []):
        out += [diag["file"], diag["kind"]]
    for section in ("mismatches", "in_flight"):  # each vbucket with a count is in the chart
        by_vbucket = report.get(section, {}).get("by_vbucket", {})
        out += [f"vbucket {vb}: " for vb, n in by_vbucket.items() if type(n) is int and n > 0]
    return [*out, report.get("left", ""), report.get("right", "")]


@given(reports())
def test_any_report_renders_with_every_value_as_text(report: dict[str, Any]) -> None:
    page_text = render_html(report)
    page_text.encode("utf-8")  # no lone surrogate reaches the file
    assert "<script" not in page_text.lower()  # nothing runs
    page = Page(page_text)
    # Nothing is fetched: no attribute that loads a URL, no CSS url() in any
    # attribute. A generated value may itself be a URL, shown as text or a label.
    assert not page.attributes & FETCHING
    assert not any("url(" in value.lower() for value in page.values)
    assert page.open == [], f"unclosed {page.open}"
    assert set(page.tags) <= ALLOWED_TAGS, set(page.tags) - ALLOWED_TAGS
    assert page.attributes <= ALLOWED_ATTRIBUTES, page.attributes - ALLOWED_ATTRIBUTES
    assert {"verdict", "summary", "by-check", "vbucket-chart", "latency", "mismatches"} <= set(
        page.ids
    )
    shown = "".join(page.text)
    for value in data_strings(report):
        if value.isprintable() and not any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            assert value in shown
    assert not any(ord(c) < 0x20 and c != "\n" for c in page_text)


def _report(**changes: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "left": "cap/tap",
        "right": "cap/upr",
        "agree": False,
        "records": {"left": 10, "right": 9},
        "keys": 5,
        "vbuckets": 2,
        "mismatches": {
            "total": 2,
            "by_check": {"value": 1, "extra": 1},
            "by_check_and_side": {"value": {"both": 1}, "extra": {"right": 1}},
            "by_vbucket": {"1": 2},
            "samples": [
                {
                    "check": "value",
                    "vbucket": 1,
                    "key": "<b>bold</b>",
                    "side": "both",
                    "detail": "value digest differs",
                    "left": {"kind": "mutation", "cas": 7, "digest": "ab"},
                    "right": {"kind": "mutation", "cas": 7, "digest": "00"},
                },
                {
                    "check": "extra",
                    "vbucket": 1,
                    "key": "hex:ff00",
                    "side": "right",
                    "detail": "only on the right",
                    "left": None,
                    "right": {"kind": "mutation", "cas": 8},
                },
            ],
        },
        "in_flight": {"total": 3, "by_vbucket": {"0": 3}, "samples": []},
        "latency": {
            "count": 4,
            "p50_s": 0.002,
            "histogram": [
                {"low_s": 0.0018, "high_s": 0.002, "count": 3},
                {"low_s": -0.002, "high_s": -0.0018, "count": 1},
            ],
        },
    }
    report.update(changes)
    return report


def test_a_disagreeing_report_shows_verdict_chart_and_records() -> None:
    page_text = render_html(_report())
    page = Page(page_text)
    assert "<b>bold</b>" not in page_text and "&lt;b&gt;bold&lt;/b&gt;" in page_text
    assert page.tags.count("b") == 2  # only the page's own "left"/"right" labels
    assert '<code class="hex"' in page_text and "hex:ff00" in "".join(page.text)
    assert page.tags.count("rect") == 2 + 2  # vbucket 1 mismatches, vbucket 0 in flight; 2 buckets
    assert 'data-vbucket="0"' in page_text and 'data-vbucket="1"' in page_text
    # The latency bars go from the most negative bucket up.
    assert page_text.index("-2ms to -1.8ms") < page_text.index("1.8ms to 2ms")
    assert "DISAGREE" in "".join(page.text) and "absent" in "".join(page.text)


def test_an_agreeing_report_says_so_and_lists_nothing() -> None:
    report = _report(agree=True)
    report["mismatches"] = {"total": 0, "by_check": {"value": 0}, "samples": []}
    report["in_flight"] = {"total": 0, "by_vbucket": {}, "samples": []}
    shown = "".join(Page(render_html(report)).text)
    assert "AGREE" in shown and "DISAGREE" not in shown
    assert "No mismatches." in shown and "No vbucket has mismatches" in shown


def test_only_the_first_records_are_listed() -> None:
    report = _report()
    sample = report["mismatches"]["samples"][0]
    report["mismatches"]["samples"] = [{**sample, "key": f"k{i}"} for i in range(FIRST_RECORDS + 5)]
    shown = "".join(Page(render_html(report)).text)
    assert f"k{FIRST_RECORDS - 1}" in shown and f"k{FIRST_RECORDS}" not in shown
    assert f"First {FIRST_RECORDS} of {FIRST_RECORDS + 5}" in shown
