"""The verification report as one self-contained HTML page (``verify --html``).

``render_html`` is a pure function of the JSON report (``report.build_report``):
inline CSS and inline SVG charts, no scripts, nothing fetched, so the file
can be mailed or attached to a ticket and opened anywhere. Every value that
comes from the data (keys, file names, details, even numbers) goes through
``_text``: control characters and lone surrogates are shown as escapes and
the rest is HTML-escaped, so a key like ``<script>`` is only ever text.
A report from an older version (without some sections) still renders.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

FIRST_RECORDS = 100
"""Mismatching records listed in the table (the report holds a sample per check)."""
CHART_WIDTH = 960
CHART_HEIGHT = 190
_MARGIN_LEFT, _MARGIN_BOTTOM, _MARGIN_TOP = 48, 36, 12
MISMATCH_COLOUR = "#c62828"
IN_FLIGHT_COLOUR = "#f0a000"
LATENCY_COLOUR = "#2f6fde"
STATE_FIELDS = ("kind", "by_seqno", "rev_seqno", "cas", "flags", "expiration", "digest")

_STYLE = """
:root { --ok: #1b7f3b; --bad: #c62828; --flight: #f0a000; --muted: #666; --line: #ddd; }
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em 2em; color: #222; background: #fafafa; }
h1 { font-size: 1.4em; margin: 0 0 .3em; }
h2 { font-size: 1.1em; margin: 1.6em 0 .4em; }
.muted { color: var(--muted); }
.verdict { display: inline-block; padding: .15em .8em; border-radius: 1em; color: #fff;
  font-weight: 700; letter-spacing: .05em; }
.agree { background: var(--ok); } .disagree { background: var(--bad); }
table { border-collapse: collapse; background: #fff; }
th, td { border-bottom: 1px solid var(--line); padding: .25em .6em; text-align: left;
  vertical-align: top; }
th { background: #f0f0f0; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font: 12px ui-monospace, monospace; word-break: break-all; }
code.hex { color: #6a3d9a; }
table.records td { font-size: 13px; }
table.records td:nth-child(3) { min-width: 12em; }
table.records td:nth-child(5) { max-width: 18em; overflow-wrap: anywhere; }
table.state code { white-space: nowrap; word-break: normal; font-size: 11px; }
table.state td, table.state th { border: 0; padding: 0 .5em 0 0; font-size: 11px;
  background: none; }
.legend span { display: inline-block; width: .9em; height: .9em; margin: 0 .3em 0 1em;
  vertical-align: -.1em; }
svg { background: #fff; border: 1px solid var(--line); max-width: 100%; height: auto; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
ul.problems { color: var(--bad); }
.row { display: flex; flex-wrap: wrap; gap: .8em 2.5em; align-items: flex-start; }
.row h2 { margin-top: 0; }
"""


def _text(value: Any) -> str:
    """Any value from the report as safe HTML text."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    chars = []
    for ch in str(value):
        code = ord(ch)
        if ch.isprintable() and not 0xD800 <= code <= 0xDFFF:
            chars.append(ch)
        elif code < 0x100:
            chars.append(f"\\x{code:02x}")
        else:
            chars.append(f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return html.escape("".join(chars), quote=True)


def _int(value: Any) -> int:
    """A count from the report (anything else, or a negative number, counts as 0)."""
    return max(value, 0) if isinstance(value, int) and not isinstance(value, bool) else 0


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else _text(value)


def _seconds(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return _text(value)
    if not math.isfinite(value):
        return _text(value)
    magnitude = abs(value)
    if magnitude == 0:
        return "0"
    if magnitude < 1e-3:
        return f"{value * 1e6:.0f}\u00b5s"
    if magnitude < 1:
        return f"{value * 1e3:.3g}ms"
    return f"{value:.3g}s"


def _key(value: Any) -> str:
    """A key as the report wrote it: UTF-8 text, or ``hex:...`` for other bytes."""
    if isinstance(value, str) and value.startswith("hex:"):
        return f'<code class="hex" title="not printable UTF-8: hex bytes">{_text(value)}</code>'
    return f"<code>{_text(value)}</code>"


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else []


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], css: str = "") -> str:
    """Cells are HTML already (escaped by the caller); a head starting with '#' is numeric."""
    heads = list(head)
    numeric = [h.startswith("#") for h in heads]
    out = [f'<table class="{css}">' if css else "<table>", "<thead><tr>"]
    for h, num in zip(heads, numeric, strict=True):
        out.append(f'<th class="num">{h[1:]}</th>' if num else f"<th>{h}</th>")
    out.append("</tr></thead><tbody>")
    for row in rows:
        cells = [
            f'<td class="num">{c}</td>' if num else f"<td>{c}</td>"
            for c, num in zip(row, numeric, strict=False)
        ]
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _summary(report: Mapping[str, Any]) -> str:
    agree = report.get("agree") is True
    mism = _dict(report.get("mismatches"))
    flight = _dict(report.get("in_flight"))
    records, items, segments = (
        _dict(report.get(name)) for name in ("records", "items", "segments")
    )
    timing = _dict(report.get("timing"))
    verdict = (
        '<span class="verdict agree" id="verdict">AGREE</span>'
        if agree
        else '<span class="verdict disagree" id="verdict">DISAGREE</span>'
    )
    sides = [
        [
            f"<b>{side}</b>",
            _key(report.get(side)),
            _count(records.get(side)),
            _count(items.get(side)),
            _count(segments.get(side)),
        ]
        for side in ("left", "right")
    ]
    figures = [
        ["Mismatches", _count(mism.get("total"))],
        ["In flight (past the cut, not a failure)", _count(flight.get("total"))],
        ["Keys", _count(report.get("keys"))],
        ["Vbuckets", _count(report.get("vbuckets"))],
        ["Time", _seconds(timing.get("total_s"))],
        ["Spark master", _text(report.get("master"))],
    ]
    return (
        f"<h1>{verdict} <span class='muted'>verify report</span></h1>"
        '<div class="row"><section id="summary">'
        + _table(["Side", "Capture", "#Records", "#Items", "#Segments"], sides)
        + "<p></p>"
        + _table(["Figure", "#Value"], figures, "figures")
        + "</section><section><h2>Mismatches by check</h2>"
        + _by_check(report)
        + "</section></div>"
    )


def _by_check(report: Mapping[str, Any]) -> str:
    mism = _dict(report.get("mismatches"))
    sides = _dict(mism.get("by_check_and_side"))
    rows = [
        [
            _text(check),
            _count(count),
            _text(", ".join(f"{s} {n}" for s, n in sorted(_dict(sides.get(check)).items()))),
        ]
        for check, count in _dict(mism.get("by_check")).items()
        if count
    ]
    if not rows:
        return '<p id="by-check">No mismatches.</p>'
    return '<div id="by-check">' + _table(["Check", "#Count", "By side"], rows) + "</div>"


def _axis_max(value: int) -> int:
    """A round top for a count axis."""
    if value <= 5:
        return max(value, 1)
    scale: int = 10 ** (len(str(value)) - 1)
    for step in (1, 2, 5, 10):
        if value <= step * scale:
            return step * scale
    return 10 * scale  # pragma: no cover - the loop always returns


def _vbucket_order(vb: str) -> tuple[bool, int, str]:
    """Numeric vbuckets in numeric order (anything else after them)."""
    numeric = vb.isascii() and vb.isdigit()
    return (not numeric, int(vb) if numeric else 0, vb)


def _vbucket_chart(report: Mapping[str, Any]) -> str:
    mism = {
        str(k): _int(v) for k, v in _dict(_dict(report.get("mismatches")).get("by_vbucket")).items()
    }
    flight = {
        str(k): _int(v) for k, v in _dict(_dict(report.get("in_flight")).get("by_vbucket")).items()
    }
    vbuckets = sorted(
        (vb for vb in set(mism) | set(flight) if mism.get(vb) or flight.get(vb)),
        key=_vbucket_order,
    )
    if not vbuckets:
        return (
            '<p id="vbucket-chart" class="muted">'
            "No vbucket has mismatches or changes in flight.</p>"
        )
    top = _axis_max(max(max(mism.get(vb, 0), flight.get(vb, 0)) for vb in vbuckets))
    plot_w = CHART_WIDTH - _MARGIN_LEFT - 8
    plot_h = CHART_HEIGHT - _MARGIN_BOTTOM - _MARGIN_TOP
    slot = plot_w / len(vbuckets)
    bar = max(slot * 0.4, 0.5)
    label_every = max(1, math.ceil(len(vbuckets) / 40))
    parts = [_frame("vbucket-chart", "Mismatches and changes in flight per vbucket", top)]
    for i, vb in enumerate(vbuckets):
        x = _MARGIN_LEFT + i * slot + slot * 0.1
        title = f"vbucket {vb}: {mism.get(vb, 0):,} mismatches, {flight.get(vb, 0):,} in flight"
        parts.append(f'<g class="vbucket" data-vbucket="{_text(vb)}"><title>{_text(title)}</title>')
        for offset, count, colour, css in (
            (0.0, mism.get(vb, 0), MISMATCH_COLOUR, "mismatch"),
            (bar, flight.get(vb, 0), IN_FLIGHT_COLOUR, "in-flight"),
        ):
            if count:
                h = plot_h * count / top
                parts.append(
                    f'<rect class="{css}" x="{x + offset:.2f}" y="{_MARGIN_TOP + plot_h - h:.2f}" '
                    f'width="{bar:.2f}" height="{h:.2f}" fill="{colour}"/>'
                )
        parts.append("</g>")
        if i % label_every == 0:
            parts.append(
                f'<text x="{x + bar:.2f}" y="{CHART_HEIGHT - _MARGIN_BOTTOM + 14}" '
                f'text-anchor="middle">{_text(vb)}</text>'
            )
    parts.append(
        f'<text x="{_MARGIN_LEFT + plot_w / 2:.0f}" y="{CHART_HEIGHT - 6}" '
        'text-anchor="middle">vbucket</text></svg>'
    )
    legend = (
        f'<p class="legend"><span style="background:{MISMATCH_COLOUR}"></span>mismatches'
        f'<span style="background:{IN_FLIGHT_COLOUR}"></span>in flight (not a failure)'
        f" <span class='muted' style='background:none;width:auto'>"
        f"· vbuckets without either are left out</span></p>"
    )
    return "".join(parts) + legend


def _frame(ident: str, label: str, top: int) -> str:
    """An SVG with its count axis (0 .. top) and grid lines."""
    plot_h = CHART_HEIGHT - _MARGIN_BOTTOM - _MARGIN_TOP
    parts = [
        f'<svg id="{ident}" role="img" aria-label="{label}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{CHART_WIDTH}" height="{CHART_HEIGHT}" '
        f'viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}">'
    ]
    for tick in sorted({0, top // 2, top} if top > 1 else {0, top}):
        y = _MARGIN_TOP + plot_h - plot_h * tick / top
        parts.append(
            f'<line x1="{_MARGIN_LEFT}" x2="{CHART_WIDTH - 8}" y1="{y:.2f}" y2="{y:.2f}" '
            'stroke="#e4e4e4"/>'
            f'<text x="{_MARGIN_LEFT - 6}" y="{y + 4:.2f}" text-anchor="end">{tick:,}</text>'
        )
    return "".join(parts)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _middle(low: float, high: float) -> float:
    """A log-scale bucket's geometric middle (0 for the bucket around zero)."""
    if low * high <= 0:
        return 0.0
    return math.copysign(math.sqrt(low * high), low)


def _latency(report: Mapping[str, Any]) -> str:
    lat = _dict(report.get("latency"))
    if not _int(lat.get("count")):
        return '<p id="latency" class="muted">No version was seen on both sides.</p>'
    figures = _table(
        ["#Versions", "#Min", "#p50", "#p90", "#p99", "#p99.9", "#Max", "#Mean"],
        [
            [_count(lat.get("count"))]
            + [_seconds(lat.get(k)) for k in ("min_s", "p50_s", "p90_s", "p99_s", "p999_s")]
            + [_seconds(lat.get("max_s")), _seconds(lat.get("mean_s"))]
        ],
    )
    buckets = [
        (low, high, _int(b.get("count")))
        for b in map(_dict, _list(lat.get("histogram")))
        if (low := _number(b.get("low_s"))) is not None
        and (high := _number(b.get("high_s"))) is not None
        and _int(b.get("count"))
    ]
    intro = (
        "<p class='muted'>Arrival time on the right minus on the left, per version seen on "
        "both sides (negative: the right had it first). Buckets are about 12% wide.</p>"
    )
    if not buckets:
        return f'<div id="latency">{intro}{figures}</div>'
    buckets.sort()
    top = _axis_max(max(n for _, _, n in buckets))
    plot_w = CHART_WIDTH - _MARGIN_LEFT - 8
    plot_h = CHART_HEIGHT - _MARGIN_BOTTOM - _MARGIN_TOP
    slot = plot_w / len(buckets)
    parts = [_frame("latency-chart", "Latency distribution between the sides", top)]
    label_every = max(1, math.ceil(len(buckets) / 8))
    for i, (low, high, n) in enumerate(buckets):
        x = _MARGIN_LEFT + i * slot
        h = max(plot_h * n / top, 1.5)  # a bucket of a few versions stays visible
        if i and buckets[i - 1][0] < 0 <= low:  # where the right stops having it first
            parts.append(
                f'<line class="zero" x1="{x:.2f}" x2="{x:.2f}" y1="{_MARGIN_TOP}" '
                f'y2="{_MARGIN_TOP + plot_h}" stroke="#888" stroke-dasharray="4 3"/>'
            )
        title = f"{_seconds(low)} to {_seconds(high)}: {n:,} versions"
        parts.append(
            f'<rect class="latency" x="{x + slot * 0.05:.2f}" y="{_MARGIN_TOP + plot_h - h:.2f}" '
            f'width="{max(slot * 0.9, 0.5):.2f}" height="{h:.2f}" fill="{LATENCY_COLOUR}">'
            f"<title>{title}</title></rect>"
        )
        if i % label_every == 0:
            parts.append(
                f'<text x="{x + slot / 2:.2f}" y="{CHART_HEIGHT - _MARGIN_BOTTOM + 14}" '
                f'text-anchor="middle">{_seconds(_middle(low, high))}</text>'
            )
    parts.append(
        f'<text x="{_MARGIN_LEFT + plot_w / 2:.0f}" y="{CHART_HEIGHT - 6}" '
        'text-anchor="middle">latency right - left (non-empty buckets, log scale)</text></svg>'
    )
    return f'<div id="latency">{intro}{figures}<p></p>{"".join(parts)}</div>'


def _state(state: Any) -> str:
    fields = _dict(state)
    if not fields:
        return '<span class="muted">absent</span>'
    rows = "".join(
        f"<tr><th>{name}</th><td>{_code(fields.get(name))}</td></tr>"
        for name in STATE_FIELDS
        if fields.get(name) is not None
    )
    return f'<table class="state">{rows}</table>'


def _code(value: Any) -> str:
    return f"<code>{_text(value)}</code>"


def _records(samples: Sequence[Any], ident: str, empty: str) -> str:
    rows = [
        [
            _text(s.get("check")),
            _count(s.get("vbucket")),
            _key(s.get("key")),
            _text(s.get("side")),
            _text(s.get("detail")),
            _state(s.get("left")),
            _state(s.get("right")),
        ]
        for s in map(_dict, samples[:FIRST_RECORDS])
    ]
    if not rows:
        return f'<p id="{ident}" class="muted">{empty}</p>'
    more = (
        f"<p class='muted'>First {FIRST_RECORDS:,} of {len(samples):,} sampled records.</p>"
        if len(samples) > FIRST_RECORDS
        else ""
    )
    head = ["Check", "#Vbucket", "Key", "Side", "Detail", "Left", "Right"]
    return f'<div id="{ident}">' + _table(head, rows, "records") + more + "</div>"


def _diagnostics(report: Mapping[str, Any]) -> str:
    diags = [_dict(d) for d in _list(report.get("diagnostics"))]
    if not diags:
        return ""
    items = "".join(
        f"<li>{_text(d.get('kind'))} segment ({_text(d.get('side'))}) {_code(d.get('file'))}: "
        f"{_text(d.get('detail'))}</li>"
        for d in diags
    )
    return f'<h2>Capture segments</h2><ul class="problems" id="diagnostics">{items}</ul>'


def render_html(report: Mapping[str, Any]) -> str:
    """The whole page for a verify report (the JSON document ``verify --report`` writes)."""
    mism = _dict(report.get("mismatches"))
    flight = _dict(report.get("in_flight"))
    title = "AGREE" if report.get("agree") is True else "DISAGREE"
    body = [
        _summary(report),
        "<h2>Per vbucket</h2>",
        _vbucket_chart(report),
        "<h2>Latency between the sides</h2>",
        _latency(report),
        "<h2>First mismatching records</h2>",
        _records(_list(mism.get("samples")), "mismatches", "No mismatching records."),
        "<h2>Changes in flight (sample)</h2>",
        _records(_list(flight.get("samples")), "in-flight", "No changes in flight."),
        _diagnostics(report),
    ]
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>verify: {title}: {_text(report.get('left'))} vs "
        f"{_text(report.get('right'))}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
