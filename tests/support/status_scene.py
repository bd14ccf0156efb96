"""A gateway with something to show: the scene the status page test and
``scripts/status-screenshot`` look at.

``serve`` runs both fronts over its embedded node (with sample data and live
writes); a TAP client ``replica-east`` backfills at a paced rate (so its
vbuckets show progress and an ETA), a TAP client ``reporting`` connects and
reads nothing (so its lag grows), and a UPR consumer ``indexer`` streams four
vbuckets from the UPR front.

Run as a program it writes a screenshot of the page:
``python -m tests.support.status_scene docs/status-page.png``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import trio

from adapters.tap import ConnectFlags
from gateway.cli.serve import Running, ServeOptions, run_serve
from tests.support.tap_client import TapClient, connect_event, wants_ack
from tests.support.upr_client import UprClient

ANY_PORT = ("127.0.0.1", 0)
PACED_BATCH = 25
PACED_PAUSE = 0.05
"""A batch of 25 every 50 ms: at most 500 items/s, so a backfill lasts a while."""


async def _paced_tap_client(port: int) -> None:
    flags = ConnectFlags.BACKFILL | ConnectFlags.SUPPORT_ACK
    client = await TapClient.open(port, connect_event(b"replica-east", flags, backfill_date=0))
    count = 0
    while (event := await client.next_event()) is not None:
        if wants_ack(event):
            await client.ack(event)  # type: ignore[arg-type]
        count += 1
        if count % PACED_BATCH == 0:
            await trio.sleep(PACED_PAUSE)  # pacing, so the backfill is seen under way


async def _stalled_tap_client(port: int) -> None:
    flags = ConnectFlags.BACKFILL | ConnectFlags.SUPPORT_ACK
    client = await TapClient.open(port, connect_event(b"reporting", flags, backfill_date=0))
    await trio.sleep_forever()
    await client.aclose()  # pragma: no cover


async def _upr_consumer(port: int) -> None:
    consumer = await UprClient.connect(port)
    await consumer.open(b"indexer")
    for vb in range(4):
        await consumer.stream_request(vb)
    while True:
        await consumer.receive()


async def start_scene(
    nursery: trio.Nursery,
    state_dir: Path,
    *,
    sample_items: int = 40_000,
    per_vbucket_metrics: bool = False,
) -> Running:
    options = ServeOptions(
        tap_listen=ANY_PORT, upr_listen=ANY_PORT, metrics_listen=ANY_PORT, state_dir=state_dir,
        embedded_vbuckets=16, embedded_sample_items=sample_items, embedded_writes_per_second=20,
        per_vbucket_metrics=per_vbucket_metrics,
    )  # fmt: skip
    running: Running = await nursery.start(run_serve, options)
    assert running.tap_port and running.upr_port
    nursery.start_soon(_paced_tap_client, running.tap_port)
    nursery.start_soon(_stalled_tap_client, running.tap_port)
    nursery.start_soon(_upr_consumer, running.upr_port)
    return running


def fetch_status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=10) as answer:
        doc: dict[str, Any] = json.load(answer)
    return doc


async def wait_for_backfill_eta(port: int) -> dict[str, Any]:
    """Poll ``/status.json`` until ``replica-east`` shows a backfill with an ETA
    and every connection of the scene is listed (the caller bounds the time)."""
    while True:
        doc = await trio.to_thread.run_sync(fetch_status, port)
        streams = {s["connection"]: s for s in doc["streams"]}
        east = streams.get("replica-east")
        if (
            {"replica-east", "reporting", "indexer"} <= set(streams)
            and east is not None
            and any(b["eta_seconds"] is not None for b in east["backfills"])
        ):
            return doc
        await trio.sleep(0.2)


async def _screenshot(out: Path) -> None:
    from tests.support.chromium import screenshot

    with tempfile.TemporaryDirectory(prefix="status-scene-") as state:
        async with trio.open_nursery() as nursery:
            running = await start_scene(nursery, Path(state))
            assert running.metrics_port
            with trio.fail_after(60):
                await wait_for_backfill_eta(running.metrics_port)
            url = f"http://127.0.0.1:{running.metrics_port}/"
            await screenshot(url, out, size=(1280, 600))
            nursery.cancel_scope.cancel()
    print(f"wrote {out}")


if __name__ == "__main__":
    trio.run(_screenshot, Path(sys.argv[1] if len(sys.argv) > 1 else "docs/status-page.png"))
