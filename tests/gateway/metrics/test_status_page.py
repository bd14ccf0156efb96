"""The status page at ``/`` and ``/status.json`` (gateway/metrics/status.py,
status.html): rendered by real headless Chromium against a real ``serve``
with streams in both directions, and the JSON's invariants under hypothesis."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.metrics.figures import DIRECTIONS, GatewayStats, StreamStats
from gateway.metrics.health import Health
from gateway.metrics.status import BackfillTracker, status
from gateway.metrics.view import capture
from tests.support.chromium import CHROMIUM, MISSING, dump_dom
from tests.support.status_scene import start_scene, wait_for_backfill_eta


class Rows(HTMLParser):
    """The page's table rows: (attributes of the <tr>, texts of its cells)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[dict[str, str], list[str]]] = []
        self.ids: dict[str, str] = {}
        self._cell: list[str] | None = None
        self._id: str | None = None
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = attributes
        if tag == "tr":
            self.rows.append((attributes, []))
        elif tag in ("td", "th"):
            self._cell = []
        if "id" in attributes:
            self._id = attributes["id"]

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self.rows:
            self.rows[-1][1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._id is not None and data.strip():
            self.ids.setdefault(self._id, data.strip())


ETA = re.compile(r"[\d.]+ s|\d+ min \d+ s|\d+ h \d+ min")


@pytest.mark.skipif(CHROMIUM is None, reason=MISSING)
async def test_status_page_shows_fronts_streams_and_backfills_in_chromium(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    running = await start_scene(nursery, tmp_path)
    port = running.metrics_port
    assert port
    with trio.fail_after(90):
        await wait_for_backfill_eta(port)
        # The backfill is live: a vbucket seen with an ETA by the poll may have
        # finished by the time Chromium fetches the page, and the next one has
        # no rate yet. Render again until the page itself shows an ETA.
        while True:
            page = Rows()
            page.feed(await dump_dom(f"http://127.0.0.1:{port}/"))
            if any(ETA.fullmatch(cells[5]) for a, cells in page.rows if "data-vbucket" in a):
                break
    assert int(page.body.get("data-rendered", "0")) >= 1, "the page's script never rendered"
    assert page.ids["ready"] == "ready"
    fronts = {a["data-direction"]: cells for a, cells in page.rows if "data-direction" in a
              and "data-connection" not in a}  # fmt: skip
    assert fronts["tap_front"][0] == "TAP front" and fronts["upr_front"][0] == "UPR front"
    assert fronts["tap_front"][3] == "connected" and fronts["tap_front"][4] == "2"
    streams = {a["data-connection"]: cells for a, cells in page.rows if "data-connection" in a}
    assert set(streams) == {"replica-east", "reporting", "indexer"}
    assert streams["indexer"][0] == "UPR front" and streams["replica-east"][0] == "TAP front"
    # The stalled client's lag shows in items (a number) and in seconds.
    assert int(streams["reporting"][6].replace(",", "")) > 0
    assert streams["reporting"][7].endswith(" s")
    vb_rows = [cells for a, cells in page.rows if "data-vbucket" in a]
    assert vb_rows, "no backfill rows rendered"
    assert all(re.fullmatch(r"\d+\.\d %", cells[1]) for cells in vb_rows)
    etas = [cells[5] for cells in vb_rows]
    assert all(ETA.fullmatch(eta) or eta in ("estimating", "stalled") for eta in etas), etas


def test_backfill_eta_from_the_average_rate() -> None:
    tracker = BackfillTracker()
    key = (("tap_front", "east", "node:11210"), 3)
    assert tracker.rate_and_eta({key: (100, 900)}, now=10.0)[key] == (None, None, False)
    rate, eta, stalled = tracker.rate_and_eta({key: (300, 700)}, now=12.0)[key]
    assert (rate, eta, stalled) == (100.0, 7.0, False)
    assert tracker.rate_and_eta({}, now=13.0) == {}
    # Forgotten once it ended: a new backfill starts a new estimate.
    assert tracker.rate_and_eta({key: (300, 700)}, now=20.0)[key] == (None, None, False)
    assert tracker.rate_and_eta({key: (300, 700)}, now=30.0)[key] == (None, None, True)


vb_progress = st.tuples(
    st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.booleans(),
    st.integers(0, 2 * 10**6),
)  # fmt: skip
streams_strategy = st.lists(
    st.tuples(
        st.sampled_from(DIRECTIONS),
        st.text(min_size=0, max_size=8),
        st.dictionaries(st.integers(0, 1023), vb_progress, max_size=80),
        st.floats(0, 2e9, allow_nan=False),
    ),
    max_size=6,
    unique_by=lambda stream: (stream[0], stream[1]),  # namesakes merge (view.py); not here
)


@settings(max_examples=150, deadline=None)
@given(streams=streams_strategy, later=st.floats(0, 100, allow_nan=False))
def test_status_document_invariants(
    streams: list[tuple[str, str, dict[int, tuple[int, int, int, bool, int]], float]],
    later: float,
) -> None:
    stats = GatewayStats()
    for n, (direction, name, vbuckets, created) in enumerate(streams):
        stream = StreamStats(direction, name, "node:11210", created=created)
        for vb, (high, sent, acked, backfilling, end) in vbuckets.items():
            p = stream.vbucket(vb)
            p.upstream_high_seqno, p.sent_seqno, p.acked_seqno = high, sent, acked
            p.backfilling, p.backfill_end_seqno = backfilling, end
        stats.streams[n] = stream
    tracker = BackfillTracker()
    health = Health()
    for now in (1e9, 1e9 + later):
        doc = status(capture(stats, now), health.snapshot(now), tracker)
        json.dumps(doc, allow_nan=False)  # a valid JSON document, always
        keys = {(s["direction"], s["connection"]) for s in doc["streams"]}
        assert keys == {(d, n) for d, n, _, _ in streams}
        for s in doc["streams"]:
            assert s["send_lag_items"] >= 0 and s["ack_lag_items"] >= 0
            assert len(s["backfills"]) <= 64
            assert len(s["backfills"]) + s["backfills_not_shown"] == s["backfilling_vbuckets"]
            for b in s["backfills"]:
                assert 0.0 <= b["percent"] <= 100.0
                assert b["remaining"] == b["end_seqno"] - b["sent_seqno"] >= 0
                assert b["eta_seconds"] is None or b["eta_seconds"] >= 0
