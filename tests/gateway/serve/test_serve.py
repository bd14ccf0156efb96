"""``serve``: the fronts, the metrics endpoint and the embedded upstream, wired together."""

from __future__ import annotations

from pathlib import Path

import trio

from adapters.tap import ConnectFlags, TapMutation
from gateway.cli.serve import ServeOptions, run_serve
from gateway.io.connection import PacketConnection
from tests.support.tap_client import TapClient, connect_event, start_node
from tests.support.tapfront import Replica, catch_up, filled_store

F = ConnectFlags
ANY_PORT = ("127.0.0.1", 0)


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    await stream.aclose()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_tap_front_and_metrics_over_a_given_upr_upstream(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, node_port = await start_node(nursery, store)
    options = ServeOptions(
        tap_listen=ANY_PORT, upr_upstream=("127.0.0.1", node_port), metrics_listen=ANY_PORT
    )
    running = await nursery.start(run_serve, options)
    assert running.upr_port is None and running.embedded_port is None
    assert running.tap_port and running.metrics_port
    replica = Replica()
    with trio.fail_after(20):
        client = await TapClient.open(
            running.tap_port, connect_event(b"ops", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
        )
        await catch_up(client, replica, store)
        async with await PacketConnection.connect("127.0.0.1", running.tap_port) as admin:
            stats = await admin.stats("tap")
        assert int(stats["ep_tap_count"]) == 1
        status, body = await http_get(running.metrics_port, "/metrics")
        assert status == 200
        assert b'connection="ops"' in body and b"tapupr_" in body
        await client.aclose()


async def test_with_no_upstream_both_fronts_serve_the_embedded_node(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    from tests.support.upr_client import UprClient

    options = ServeOptions(
        tap_listen=ANY_PORT,
        upr_listen=ANY_PORT,
        metrics_listen=ANY_PORT,
        state_dir=tmp_path,
        embedded_vbuckets=4,
        embedded_sample_items=200,
        embedded_writes_per_second=50,
    )
    running = await nursery.start(run_serve, options)
    assert running.embedded_port and running.tap_port and running.upr_port
    with trio.fail_after(20):
        client = await TapClient.open(
            running.tap_port, connect_event(b"old", F.DUMP | F.BACKFILL, backfill_date=0)
        )
        dumped = [e for e in await client.collect() if isinstance(e, TapMutation)]
        assert len({e.key for e in dumped if e.key.startswith(b"sample::")}) == 200
        consumer = await UprClient.connect(running.upr_port)
        assert (await consumer.open(b"new")).status == 0
        seqnos: dict[str, str] = {}
        while not seqnos or int(seqnos.get("vb_0:high_seqno", "0")) == 0:
            async with await PacketConnection.connect("127.0.0.1", running.upr_port) as admin:
                seqnos = await admin.stats("vbucket-seqno")
            await trio.sleep(0.05)
        high = int(seqnos["vb_0:high_seqno"])
        opaque = consumer.next_opaque()
        answer = await consumer.stream_request(0, 0, high, opaque=opaque)
        assert answer.status == 0
        log = await consumer.read_stream(opaque)
        assert log.items and log.items[-1].by_seqno == high
        await consumer.aclose()
