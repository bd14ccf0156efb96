"""End to end through the gateway: the TAP view (TAP front) and the UPR view (UPR front)
of one loaded node, captured side by side and verified equal on Spark."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

# The pipeline extra (pip install -e '.[pipeline]'): without it these tests skip.
pytest.importorskip("pyarrow", reason="needs the pipeline extra")
pytest.importorskip("pyspark", reason="needs the pipeline extra")

from gateway.cli.serve import ServeOptions, run_serve
from gateway.fronts.upr import UprFrontConfig
from gateway.node.store import Store
from gateway.tools.capture.session import CaptureOptions
from gateway.tools.capture.tap_capture import capture_tap
from gateway.tools.capture.upr_capture import capture_upr
from gateway.tools.load import run_load
from gateway.tools.verify.job import VerifyConfig, run_verify
from tests.support.tap_client import start_node, until

VBUCKETS = 8
ANY_PORT = ("127.0.0.1", 0)


def upr_front_holds_everything(node: Any, store: Store) -> bool:
    """The UPR front acknowledged (so logged) every vbucket up to the node's high seqno."""
    registration = node.tap.registration(UprFrontConfig.tap_name)
    return registration is not None and all(
        vb in registration.positions and registration.positions[vb].seqno >= store.high_seqno(vb)
        for vb in range(VBUCKETS)
    )


async def test_tap_front_and_upr_front_views_agree(
    nursery: trio.Nursery, tmp_path: Path, spark: Any
) -> None:
    store = Store(VBUCKETS, checkpoint_items=50)
    node, node_port = await start_node(nursery, store, vbuckets=VBUCKETS)
    options = ServeOptions(
        tap_listen=ANY_PORT,
        upr_listen=ANY_PORT,
        upr_upstream=("127.0.0.1", node_port),
        tap_upstream=("127.0.0.1", node_port),
        metrics_listen=None,
        state_dir=tmp_path / "state",
        capture_dir=tmp_path / "gateway-captures",
    )
    running = await nursery.start(run_serve, options)
    assert running.tap_port and running.upr_port
    with trio.fail_after(60):
        load = await run_load(
            "127.0.0.1", node_port, items=1200, value_size=40, delete_fraction=0.2
        )
        assert not load.errors and load.deletes > 0
        await run_load("127.0.0.1", node_port, items=300, value_size=50, seed=7)
        await until(lambda: upr_front_holds_everything(node, store))
        tap = CaptureOptions("127.0.0.1", running.tap_port, tmp_path / "tap", until_caught_up=True)
        upr = CaptureOptions("127.0.0.1", running.upr_port, tmp_path / "upr", until_caught_up=True)
        tap_result = await capture_tap(tap)
        upr_result = await capture_upr(upr)
    assert tap_result.stopped == upr_result.stopped == "caught-up"
    config = VerifyConfig(
        str(tmp_path / "tap"), str(tmp_path / "upr"), partitions=4, progress=False
    )
    report = (await trio.to_thread.run_sync(run_verify, config, spark)).report
    assert report["mismatches"]["total"] == 0, report["mismatches"]["samples"][:5]
    assert report["agree"]
    assert report["keys"] == sum(
        len({i.key for i in store.items_since(vb, 0)}) for vb in range(VBUCKETS)
    )
    # Both fronts recorded, per connection, what they received and what they sent; the
    # UPR front's consumer-side record is the same view the UPR capture client saw.
    recorded = tmp_path / "gateway-captures"
    names = sorted(p.name for p in recorded.iterdir())
    assert any("received" in n for n in names) and any("sent" in n for n in names), names
    consumer_view = tmp_path / "upr-front-sent"
    consumer_view.mkdir()
    for segment in recorded.iterdir():
        if segment.name.startswith("capture-upr") and ".sent." in segment.name:
            shutil.copy(segment, consumer_view)
    assert any(consumer_view.iterdir()), names
    config = VerifyConfig(str(tmp_path / "upr"), str(consumer_view), partitions=4, progress=False)
    report = (await trio.to_thread.run_sync(run_verify, config, spark)).report
    assert report["agree"], report["mismatches"]["samples"][:5]
