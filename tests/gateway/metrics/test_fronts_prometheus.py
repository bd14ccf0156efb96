"""A real Prometheus scrapes a real gateway: ``run_serve`` with both fronts over reference nodes.

Where ``test_prometheus`` moves the stats by hand, here the figures come from
the fronts themselves. One gateway serves a TAP front (over a UPR reference
node that the test can restart) and a UPR front (over a TAP reference node);
a TAP client with support-ack reads through the TAP front and a UPR consumer
with flow control through the UPR front, while a writer keeps both nodes
busy. Before Prometheus' first scrape (it needs about 5 s to hand a new
target to its scrape manager) the test makes the events the dashboard's
counters need on each front: a rollback, a stream end, an upstream
reconnect, a protocol error (UPR front). Then:

- every PromQL expression of the Grafana dashboard, with the direction
  variable set to ``tap_front`` and then ``upr_front``, parses and returns
  data for that direction's series;
- the TAP client stops acking while the writes go on: the ack lag of its
  connection, in seqnos and in seconds, rises; once it acks again both fall
  back to 0.

Two figures only a misbehaving peer moves are checked by the tests at the
bottom: protocol errors from a TAP peer, and time blocked on a full window.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import Magic, Status, encode_frame
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapEvent,
    TapOpcode,
    TapResponse,
    TapStreamMessage,
    encode,
)
from gateway.cli.serve import Running, ServeOptions, run_serve
from gateway.io.connection import PacketConnection
from gateway.io.listen import bound_port
from gateway.metrics.figures import TAP_FRONT, UPR_FRONT, GatewayStats
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store
from tests.gateway.serve.test_serve import http_get
from tests.support.fronts import tap_front_over_node
from tests.support.prometheus import (
    DashboardQuery,
    Prometheus,
    Result,
    dashboard_queries,
    grafana_substitute,
    values,
)
from tests.support.tap_client import (
    TapClient,
    connect_event,
    is_opaque,
    start_node,
    until,
    wants_ack,
)
from tests.support.tapfront import Replica, catch_up
from tests.support.upr_client import MAX_SEQNO, UprClient

F = ConnectFlags
VBUCKETS = 4  # catch_up compares the replica with vbuckets 0-3 of the node
ANY_PORT = ("127.0.0.1", 0)
WRITE_INTERVAL = 0.01
LAGGER = "lagger"
CONSUMER = "xdcr"
STREAM_REQ = upr.DCP.opcodes[upr.Command.STREAM_REQ]


def nonempty(result: Result) -> bool:
    return len(result) > 0


def write_keys(store: Store, prefix: bytes, count: int) -> None:
    now = time.time()
    for i in range(count):
        store.set(i % VBUCKETS, b"%s-%05d" % (prefix, i), b"v" * 100, now=now)


class UprNode:
    """A UPR reference node with a persistent store that can be restarted on its port."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.store = Store(VBUCKETS, data_dir=data_dir)
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> int:
        self.port = await nursery.start(self._run, self.port)
        return self.port

    async def restart(self, nursery: trio.Nursery) -> None:
        """Stop the node (its connections drop), reopen the store, listen again."""
        self.scope.cancel()
        await self.stopped.wait()  # its listener is closed: the port can be bound again
        self.store.close()
        self.store = Store(VBUCKETS, data_dir=self.data_dir)
        await self.start(nursery)

    async def _run(self, port: int, *, task_status: trio.TaskStatus[int]) -> None:
        self.scope = trio.CancelScope()
        self.stopped = stopped = trio.Event()
        config = NodeConfig(vbuckets=VBUCKETS, tap_noop_interval=0.5, tap_backoff=0.05)
        try:
            with self.scope:
                async with trio.open_nursery() as inner:
                    node = Node(self.store, config)
                    listeners = await inner.start(node.serve, "127.0.0.1", port)
                    task_status.started(bound_port(listeners))
        finally:
            stopped.set()


@dataclass
class Writer:
    """Live writes on both upstream nodes, one key per tick."""

    upr_node: UprNode
    tap_store: Store
    count: int = 0

    async def run(self) -> None:
        while True:
            key = b"live-%06d" % self.count
            now = time.time()
            for store in (self.upr_node.store, self.tap_store):
                store.set(self.count % VBUCKETS, key, b"x" * 100, now=now)
            self.count += 1
            await trio.sleep(WRITE_INTERVAL)


@dataclass
class Lagger:
    """A TAP client with support-ack that can stop acknowledging and resume."""

    client: TapClient
    acking: bool = True
    held: list[TapStreamMessage] = field(default_factory=list)
    received: int = 0
    # The reading loop and resume() both send acks: one at a time on the socket.
    sending: trio.Lock = field(default_factory=trio.Lock)

    async def run(self) -> None:
        while (event := await self.client.next_event()) is not None:
            self.received += 1
            if not wants_ack(event):
                continue
            assert isinstance(event, TapStreamMessage)
            if self.acking:
                async with self.sending:
                    await self.client.ack(event)
            else:
                self.held.append(event)

    async def resume(self) -> None:
        """Ack again: the last message held covers everything sent before it."""
        self.acking = True
        if self.held:
            last = self.held[-1]
            self.held.clear()
            async with self.sending:
                await self.client.ack(last)


async def consume(client: UprClient) -> None:
    """A UPR consumer's loop: answer what must be answered, ack the buffer as it goes."""
    while True:
        await client.answer(await client.receive())
        if client.unacked:
            await client.ack_buffer()


# -- events the dashboard's counters need ---------------------------------------


async def tap_front_rollback(
    port: int, upr_node: UprNode, tmp_path: Path, stats: GatewayStats
) -> None:
    """A registered client comes back after a failover below what it acked: one rollback."""
    flags = F.BACKFILL | F.SUPPORT_ACK | F.REGISTERED_CLIENT
    replica = Replica()
    first = await TapClient.open(port, connect_event(b"rb", flags, backfill_date=0))
    await catch_up(first, replica, upr_node.store)
    await first.aclose()
    # The session noticed the close, saved its position and let go of the name.
    await until(lambda: not any(s.connection == "rb" for s in stats.active(TAP_FRONT)))
    store = upr_node.store
    store.rollback(1, store.high_seqno(1) - 20)
    store.failover(1)
    write_keys(store, b"after-failover", 8)
    second = await TapClient.open(port, connect_event(b"rb", flags, backfill_date=0))
    resumed = await catch_up(second, replica, store)
    assert any(is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM, 1) for e in resumed)
    await second.aclose()


async def tap_front_dump(port: int) -> list[TapEvent]:
    """A dump: every stream ends (reason ok) and the front closes the connection."""
    async with await TapClient.open(port, connect_event(b"dump", F.DUMP, backfill_date=0)) as c:
        return await c.collect()


async def upr_front_events(port: int, running: Running) -> None:
    """A rollback answer, a finite stream that ends, and a malformed frame (own connection)."""
    seqnos: dict[str, str] = {}
    while int(seqnos.get("vb_0:high_seqno", "0")) == 0:
        seqnos = await stat_group(port, "vbucket-seqno")
        await trio.sleep(0.05)
    high = int(seqnos["vb_0:high_seqno"])
    client = await UprClient.connect(port)
    assert (await client.open(b"events")).status == 0
    # A uuid the front never issued, past its high seqno: it answers with a rollback.
    start = high + 5
    answer = await client.stream_request(0, start, MAX_SEQNO, uuid=0xDEAD, snap=(start, start))
    assert isinstance(answer, upr.StreamRequestRollback), answer
    opaque = client.next_opaque()
    assert (await client.stream_request(0, 0, high, opaque=opaque)).status == 0
    log = await client.read_stream(opaque)
    assert log.end is not None and log.end.reason == upr.StreamEndReason.OK
    await client.aclose()
    bad = await UprClient.connect(port)
    assert (await bad.open(b"bad")).status == 0
    # A STREAM_REQ whose extras are two bytes long: malformed.
    await bad.send_raw(encode_frame(Magic.REQUEST, STREAM_REQ, extras=b"\x00\x00"))
    assert await bad.closed_by_server()
    await bad.aclose()
    assert running.stats.protocol_errors_total[UPR_FRONT, "malformed"] >= 1


async def stat_group(port: int, group: str) -> dict[str, str]:
    async with await PacketConnection.connect("127.0.0.1", port) as admin:
        return await admin.stats(group)


# -- the dashboard, one direction at a time ----------------------------------------


def for_direction(expr: str, direction: str) -> str:
    """``expr`` as Grafana sends it with ``direction`` chosen and every other variable at All."""
    return grafana_substitute(re.sub(r"\$\{direction\}|\$direction\b", direction, expr))


def gap_of(query: DashboardQuery, gaps: dict[str, str]) -> str | None:
    return next((why for name, why in gaps.items() if name in query.expr), None)


async def check_dashboard(
    prom: Prometheus, direction: str, connection: str, gaps: dict[str, str]
) -> list[str]:
    """Every dashboard query returns data of ``direction``; the queries skipped for ``gaps``."""
    skipped: list[str] = []
    for query in dashboard_queries():
        expr = for_direction(query.expr, direction)
        # "x or vector(0)" always answers: the data must come from x itself.
        inner = expr.removesuffix(" or vector(0)")
        if gap_of(query, gaps) is not None:
            await prom.query(inner)  # it must still parse
            skipped.append(query.where)
            continue
        result = await prom.wait_for(inner, nonempty, timeout=10)
        if "$direction" in query.expr or "${direction}" in query.expr:
            for sample in result:
                assert sample["metric"].get("direction", direction) == direction, (query, sample)
        if query.label == "connection":
            assert connection in {s["metric"][query.label] for s in result}, (query, result)
        elif query.label == "direction":
            assert direction in {s["metric"][query.label] for s in result}, (query, result)
    return skipped


async def test_prometheus_sees_the_real_fronts(
    nursery: trio.Nursery,
    tmp_path: Path,
    prometheus_factory: Callable[..., AbstractAsyncContextManager[Prometheus]],
) -> None:
    upr_node = UprNode(tmp_path / "upr-node")
    write_keys(upr_node.store, b"sample", 400)
    upr_port = await upr_node.start(nursery)
    tap_store = Store(VBUCKETS)
    write_keys(tap_store, b"sample", 400)
    _, tap_node_port = await start_node(nursery, tap_store)
    options = ServeOptions(
        tap_listen=ANY_PORT,
        upr_upstream=("127.0.0.1", upr_port),
        upr_listen=ANY_PORT,
        tap_upstream=("127.0.0.1", tap_node_port),
        metrics_listen=ANY_PORT,
        per_vbucket_metrics=True,
        state_dir=tmp_path / "gateway",
    )
    running: Running = await nursery.start(run_serve, options)
    assert running.tap_port and running.upr_port and running.metrics_port
    stats = running.stats
    async with prometheus_factory([f"127.0.0.1:{running.metrics_port}"]) as prom:
        async with trio.open_nursery() as clients:
            with trio.fail_after(30):
                # While Prometheus finds its target: the events behind the counters.
                await tap_front_rollback(running.tap_port, upr_node, tmp_path, stats)
                assert (
                    stats.rollbacks_total[TAP_FRONT] == 1 and TAP_FRONT in stats.last_rollback_seqno
                )
                await tap_front_dump(running.tap_port)
                assert stats.stream_ends_total[TAP_FRONT, "ok"] >= VBUCKETS
                await upr_front_events(running.upr_port, running)

                clients.start_soon(Writer(upr_node, tap_store).run)
                lagger = Lagger(
                    await TapClient.open(
                        running.tap_port,
                        connect_event(LAGGER.encode(), F.BACKFILL | F.SUPPORT_ACK, backfill_date=0),
                    )
                )
                clients.start_soon(lagger.run)
                consumer = await UprClient.connect(running.upr_port)
                assert (await consumer.open(CONSUMER.encode())).status == 0
                assert (await consumer.control("connection_buffer_size", "65536")).status == 0
                for vb in range(VBUCKETS):
                    assert (await consumer.stream_request(vb, 0)).status == 0
                clients.start_soon(consume, consumer)

                # The UPR node goes away under the TAP front's session and comes back.
                await until(lambda: lagger.received > 400)
                await upr_node.restart(nursery)
                await until(lambda: stats.upstream_reconnects_total[f"127.0.0.1:{upr_port}"] >= 1)

            await prom.wait_for('up{job="tapupr"} == 1', nonempty)
            # Enough samples for rate() over the 5 s windows the dashboard gets here.
            await prom.wait_for(
                "count_over_time(tapupr_active_connections[5s]) >= 3", lambda r: len(r) == 2
            )
            # Protocol errors have a series only once a peer misbehaved (the test below).
            gaps = {"tapupr_protocol_errors_total": "no TAP peer misbehaved in this run"}
            skipped = await check_dashboard(prom, TAP_FRONT, LAGGER, gaps)
            assert len(skipped) == 2, skipped  # the two protocol error panels
            assert await check_dashboard(prom, UPR_FRONT, CONSUMER, {}) == []

            lag = f'tapupr_stream_ack_lag_seqnos{{direction="tap_front", connection="{LAGGER}"}}'
            age = f'tapupr_stream_ack_lag_seconds{{direction="tap_front", connection="{LAGGER}"}}'
            # A scrape may land between a send and its ack: wait for the steady value.
            await prom.wait_for(lag, lambda r: values(r) == [0])
            lagger.acking = False
            await prom.wait_for(lag, lambda r: values(r)[0] > 0)
            await prom.wait_for(age, lambda r: values(r)[0] > 0)
            rising = values(await prom.query(lag))[0]
            await prom.wait_for(lag, lambda r: values(r)[0] > rising)
            aging = values(await prom.query(age))[0]
            await prom.wait_for(age, lambda r: values(r)[0] > aging)
            assert lagger.held
            await lagger.resume()
            await prom.wait_for(lag, lambda r: values(r) == [0])
            await prom.wait_for(age, lambda r: values(r) == [0])
            clients.cancel_scope.cancel()
        await lagger.client.aclose()
        await consumer.aclose()
    nursery.cancel_scope.cancel()


async def test_tap_front_counts_bad_input_from_a_tap_peer() -> None:
    async with trio.open_nursery() as nursery:
        store = Store(VBUCKETS)
        write_keys(store, b"sample", 40)
        _, node_port = await start_node(nursery, store)
        options = ServeOptions(
            tap_listen=ANY_PORT, upr_upstream=("127.0.0.1", node_port), metrics_listen=ANY_PORT
        )
        running: Running = await nursery.start(run_serve, options)
        assert running.tap_port and running.metrics_port
        with trio.fail_after(10):
            client = await TapClient.open(
                running.tap_port,
                connect_event(b"bad", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0),
            )
            first = await client.next_event()
            # A nack neither EBUSY nor ETMPFAIL: the front closes.
            refused = TapResponse(TapOpcode.OPAQUE, first.opaque, Status.KEY_EXISTS)  # type: ignore[union-attr]
            await client.send(encode(refused))
            while await client.next_event() is not None:
                pass
            await client.aclose()
            status, body = await http_get(running.metrics_port, "/metrics")
        assert status == 200
        nursery.cancel_scope.cancel()
    assert b'tapupr_protocol_errors_total{direction="tap_front",kind="refused_ack"} 1' in body


async def test_tap_front_counts_time_blocked_on_a_full_window() -> None:
    async with trio.open_nursery() as nursery:
        store = Store(VBUCKETS)
        write_keys(store, b"slow", 4000)
        rig = await tap_front_over_node(
            nursery, store, buffer_size=32 * 1024, max_unacked=300, ack_interval=100
        )
        with trio.fail_after(10):
            client = await rig.client(b"slow", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
            # Read without acking until the front has stopped sending for a while (0.3 s).
            while True:
                with trio.move_on_after(0.3) as idle:
                    await client.next_event()
                if idle.cancelled_caught:
                    break
            stream = rig.front.sessions.get("slow").stats
            # The upstream's flow-control window is full: nothing moves until the client acks.
            assert stream.acks_pending > 0 and stream.unacked_bytes >= stream.buffer_size
            await client.aclose()
        nursery.cancel_scope.cancel()
    assert stream.blocked_total() > 0 and stream.blocked_since is not None
