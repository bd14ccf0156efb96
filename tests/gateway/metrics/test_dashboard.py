"""The Grafana dashboard and provisioning files, checked without Grafana.

Their PromQL runs against a real Prometheus in ``test_prometheus.py``; here:
the JSON's structure, that every metric it names is one the collector
exports, that every ``$variable`` is defined, and that the provisioning files
point at each other.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gateway.metrics.collector import GatewayCollector
from gateway.metrics.figures import GatewayStats
from tests.support.prometheus import (
    DASHBOARD,
    GRAFANA_BUILTINS,
    dashboard_queries,
    dashboard_variables,
)

GRAFANA = DASHBOARD.parents[1]
SUFFIXES = ("_bucket", "_count", "_sum")


def exported_names() -> set[str]:
    names = set()
    for family in GatewayCollector(GatewayStats(), per_vbucket=True).describe():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in SUFFIXES)
    return names


def board() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> list[dict]:
    return [p for panel in panels for p in (panel, *all_panels(panel.get("panels", [])))]


def test_panels_are_well_formed() -> None:
    panels = all_panels(board()["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        assert panel["title"] and panel["description"]


def test_covers_what_operators_watch() -> None:
    exprs = " ".join(q.expr for q in dashboard_queries())
    for name in (
        "tapupr_stream_send_lag_seqnos", "tapupr_stream_ack_lag_seqnos",
        "tapupr_stream_ack_lag_seconds", "tapupr_stream_ack_latency_seconds_bucket",
        "tapupr_items_sent_total", "tapupr_stream_backfill_remaining_items",
        "tapupr_stream_flow_control_blocked_seconds_total", "tapupr_stream_tap_acks_pending",
        "tapupr_stream_tap_nacks_total", "tapupr_rollbacks_total",
        "tapupr_upstream_reconnects_total", "tapupr_protocol_errors_total",
    ):  # fmt: skip
        assert name in exprs, name


def test_every_metric_named_is_exported() -> None:
    exported = exported_names()
    for query in dashboard_queries():
        for name in re.findall(r"\btapupr_\w+", query.expr):
            assert name in exported, f"{query.where}: {name} is not exported"


def test_every_variable_is_defined() -> None:
    defined = dashboard_variables() | GRAFANA_BUILTINS
    for query in dashboard_queries():
        for braced, plain in re.findall(r"\$\{(\w+)\}|\$(\w+)", query.expr):
            assert (braced or plain) in defined, f"{query.where}: ${braced or plain}"
    names = [v["name"] for v in board()["templating"]["list"]]
    assert {"datasource", "instance", "direction", "connection"} <= set(names)


def test_provisioning_files_agree() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the provisioning files")
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning/datasources/tap-upr-gateway.yaml").read_text()
    )
    providers = yaml.safe_load(
        (GRAFANA / "provisioning/dashboards/tap-upr-gateway.yaml").read_text()
    )
    assert datasources["apiVersion"] == providers["apiVersion"] == 1
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    [provider] = providers["providers"]
    assert provider["type"] == "file" and Path(provider["options"]["path"]).is_absolute()
    readme = (GRAFANA / "README.md").read_text()
    assert provider["options"]["path"] in readme
    assert "prometheus.yml" in readme
