"""End to end: the reference node under load, captured over TAP and over UPR, verified equal."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

# The pipeline extra (pip install -e '.[pipeline]'): without it these tests skip.
pytest.importorskip("pyarrow", reason="needs the pipeline extra")
pytest.importorskip("pyspark", reason="needs the pipeline extra")

from gateway.node.store import Store
from gateway.tools.capture.session import CaptureOptions
from gateway.tools.capture.tap_capture import capture_tap
from gateway.tools.capture.upr_capture import capture_upr
from gateway.tools.load import run_load
from gateway.tools.verify.job import VerifyConfig, run_verify
from tests.support.tap_client import start_node

VBUCKETS = 8


async def test_tap_and_upr_views_of_a_loaded_node_agree(
    nursery: trio.Nursery, tmp_path: Path, spark: Any
) -> None:
    store = Store(VBUCKETS, checkpoint_items=50)
    _, port = await start_node(nursery, store, vbuckets=VBUCKETS)
    load = await run_load(
        "127.0.0.1",
        port,
        items=1500,
        value_size=40,
        ttl_fraction=0.1,
        ttl_seconds=1,
        delete_fraction=0.2,
    )
    assert not load.errors and load.deletes > 0
    assert store.expire(time.time() + 10, limit=10_000)  # the TTL keys become expirations
    # A second round rewrites some keys, so histories have several versions.
    await run_load("127.0.0.1", port, items=300, value_size=50, seed=7)

    tap = CaptureOptions("127.0.0.1", port, tmp_path / "tap", until_caught_up=True)
    upr = CaptureOptions("127.0.0.1", port, tmp_path / "upr", until_caught_up=True)
    tap_result = await capture_tap(tap)
    upr_result = await capture_upr(upr)
    assert tap_result.stopped == upr_result.stopped == "caught-up"
    assert upr_result.kinds["expiration"] > 0 and tap_result.kinds["delete"] > 0

    config = VerifyConfig(
        str(tmp_path / "tap"), str(tmp_path / "upr"), partitions=4, progress=False
    )
    report = (await trio.to_thread.run_sync(run_verify, config, spark)).report
    assert report["mismatches"]["total"] == 0, report["mismatches"]["samples"][:5]
    assert report["agree"]
    assert report["keys"] == sum(
        len({i.key for i in store.items_since(vb, 0)}) for vb in range(VBUCKETS)
    )
    assert report["latency"]["count"] == report["items"]["left"]

    # One item changed behind the captures' backs: the UPR view now disagrees.
    vb = next(vb for vb in range(VBUCKETS) if store.high_seqno(vb))
    item = store.items_since(vb, 0)[-1]
    store.set(vb, item.key, b"changed", now=time.time())
    upr2 = CaptureOptions("127.0.0.1", port, tmp_path / "upr2", until_caught_up=True)
    await capture_upr(upr2)
    config = VerifyConfig(
        str(tmp_path / "tap"), str(tmp_path / "upr2"), partitions=4, progress=False
    )
    report = (await trio.to_thread.run_sync(run_verify, config, spark)).report
    assert not report["agree"]
    checks = {(s["check"], s["vbucket"], s["key"]) for s in report["mismatches"]["samples"]}
    assert ("value", vb, item.key.decode()) in checks
