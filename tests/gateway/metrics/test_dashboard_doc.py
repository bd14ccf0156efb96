"""``docs/dashboard-queries.md``: the Grafana dashboard's queries answered by a
real Prometheus scraping a real ``serve`` (tests/support/dashboard_doc.py,
which ``scripts/dashboard-queries`` runs to regenerate the file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dashboard_doc import documented_queries, markdown, scene_answers, summary
from tests.support.prometheus import MISSING, PROMETHEUS, dashboard_queries

DOC = Path(__file__).resolve().parents[3] / "docs" / "dashboard-queries.md"

# Panels the scene must light up: streams in both directions, lag, a backfill.
MUST_HAVE_DATA = {
    "Lag in seqnos: not yet acknowledged / A",
    "Lag in seconds: oldest unacknowledged item / A",
    "Items sent per second, by stream / A",
    "Backfill remaining / A",
    "Per-vbucket lag (with --per-vbucket-metrics) / A",
    "Connections / A",
    "Log size on disk / A",
    "variable connection",
}


def test_the_document_lists_every_dashboard_query() -> None:
    """Regenerate with scripts/dashboard-queries when the dashboard changes."""
    assert documented_queries(DOC.read_text()) == [q.where for q in dashboard_queries()]


@pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)
async def test_every_dashboard_query_answers_against_a_real_serve(tmp_path: Path) -> None:
    answers = await scene_answers(tmp_path)  # a PromQL error raises here
    assert [a.query.where for a in answers] == [q.where for q in dashboard_queries()]
    by_panel = {a.query.where: a for a in answers}
    for where in MUST_HAVE_DATA:
        assert by_panel[where].result, f"{where}: no data"
    connections = summary(by_panel["variable connection"])[1].split("; ")
    assert connections == ["indexer", "replica-east", "reporting"]
    # The regenerated document has the same rows as the committed one.
    assert documented_queries(markdown(answers)) == documented_queries(DOC.read_text())
