"""serve_metrics over real loopback sockets: formats, negotiation, bad requests, limits."""

from __future__ import annotations

import gzip
import json
import urllib.request
from dataclasses import dataclass

import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)

from gateway.metrics import serve_metrics
from gateway.metrics import server as server_module
from gateway.metrics.figures import TAP_FRONT, UPR_FRONT, GatewayStats, StreamStats
from tests.gateway.metrics.conftest import parse, value


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


class Client:
    """Raw HTTP/1.1 over one connection, so malformed requests can be sent too."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(65536)
        self.buffer += data
        return bool(data)

    async def reply(self, *, head_only: bool = False) -> Reply:
        while b"\r\n\r\n" not in self.buffer:
            assert await self._fill(), f"closed before a reply; got {bytes(self.buffer)!r}"
        end = self.buffer.index(b"\r\n\r\n") + 4
        lines = bytes(self.buffer[: end - 4]).decode("latin-1").split("\r\n")
        del self.buffer[:end]
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = 0 if head_only else int(headers["content-length"])
        while len(self.buffer) < length:
            assert await self._fill(), "closed inside a body"
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return Reply(status, headers, body)

    async def request(self, raw: bytes, *, head_only: bool = False) -> Reply:
        await self.stream.send_all(raw)
        return await self.reply(head_only=head_only)

    async def closed(self) -> bool:
        with trio.move_on_after(5):
            while await self._fill():
                pass
            return True
        return False


def get(path: str = "/metrics", *extra: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: test", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def start(nursery: trio.Nursery, stats: GatewayStats, **kw: object) -> int:
    port: int = await nursery.start(lambda task_status: serve_metrics(
        stats, "127.0.0.1", 0, task_status=task_status, **kw  # type: ignore[arg-type]
    ))  # fmt: skip
    return port


async def connect(port: int) -> Client:
    return Client(await trio.open_tcp_stream("127.0.0.1", port))


def busy_stats() -> GatewayStats:
    stats = GatewayStats()
    stream = StreamStats(TAP_FRONT, "replica-1", "node:11210")
    stats.streams[id(stream)] = stream
    stream.items_sent["mutation"] += 3
    stream.vbucket(0).upstream_high_seqno = 9
    return stats


async def test_text_format_by_default_with_keep_alive(nursery: trio.Nursery) -> None:
    stats = busy_stats()
    port = await start(nursery, stats)
    client = await connect(port)
    first = await client.request(get())
    assert first.status == 200
    assert first.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse(first.body.decode())
    labels = {"direction": TAP_FRONT, "connection": "replica-1", "upstream": "node:11210"}
    assert value(samples, "tapupr_stream_send_lag_seqnos", **labels) == 9
    assert any(name == "process_cpu_seconds_total" for name, _ in samples)
    stats.streams.clear()
    second = await client.request(get())  # same connection
    assert value(parse(second.body.decode()), "tapupr_active_connections", direction=TAP_FRONT) == 0


async def test_openmetrics_when_asked(nursery: trio.Nursery) -> None:
    port = await start(nursery, busy_stats())
    client = await connect(port)
    accept = "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    reply = await client.request(get("/metrics", accept))
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("application/openmetrics-text")
    assert "Accept" in reply.headers["vary"]
    text = reply.body.decode()
    assert text.endswith("# EOF\n")
    families = {f.name for f in parse_openmetrics(text)}
    assert "tapupr_stream_items_sent" in families


async def test_gzip_when_accepted(nursery: trio.Nursery) -> None:
    port = await start(nursery, busy_stats())
    client = await connect(port)
    reply = await client.request(get("/metrics", "Accept-Encoding: gzip"))
    assert reply.headers["content-encoding"] == "gzip"
    assert b"tapupr_stream_items_sent_total" in gzip.decompress(reply.body)


async def test_head_and_index(nursery: trio.Nursery) -> None:
    port = await start(nursery, busy_stats())
    client = await connect(port)
    head = await client.request(b"HEAD /metrics HTTP/1.1\r\nHost: t\r\n\r\n", head_only=True)
    assert head.status == 200 and int(head.headers["content-length"]) > 0
    index = await client.request(get("/"))
    assert index.status == 200 and b"/metrics" in index.body


async def test_urllib_scrape(nursery: trio.Nursery) -> None:
    port = await start(nursery, busy_stats())

    def fetch() -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return bytes(r.read())

    assert b"tapupr_active_connections" in await trio.to_thread.run_sync(fetch)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (get("/nope"), 404),
        (b"POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", 405),
        (b"PUT /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody", 413),
        (b"GET /metrics\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\n\r\n", 400),
        (b"GET /metrics HTTP/3.0\r\nHost: t\r\n\r\n", 505),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # TLS hello
    ],
)
async def test_bad_requests_answered_and_closed(
    nursery: trio.Nursery, raw: bytes, status: int
) -> None:
    port = await start(nursery, busy_stats())
    client = await connect(port)
    reply = await client.request(raw)
    assert reply.status == status
    assert reply.headers["connection"] == "close"
    assert reply.body.startswith(str(status).encode())
    if status == 405:
        assert reply.headers["allow"] == "GET, HEAD"
    assert await client.closed()
    # The server still serves others.
    assert (await (await connect(port)).request(get())).status == 200


async def test_oversized_head_is_refused(nursery: trio.Nursery) -> None:
    port = await start(nursery, busy_stats())
    client = await connect(port)
    reply = await client.request(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
    assert reply.status == 431
    assert await client.closed()


async def test_slow_head_times_out_with_408(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    monkeypatch.setattr(server_module, "HEAD_TIMEOUT", 1.0)
    port = await start(nursery, busy_stats())
    client = await connect(port)
    await client.stream.send_all(b"GET /metrics HTTP/1.1\r\n")
    reply = await client.reply()
    assert reply.status == 408


async def test_idle_connection_closed_silently(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    monkeypatch.setattr(server_module, "IDLE_TIMEOUT", 1.0)
    port = await start(nursery, busy_stats())
    client = await connect(port)
    assert await client.closed()
    assert client.buffer == b""


async def test_connection_limit_answers_503_when_all_are_mid_request(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 2)
    port = await start(nursery, busy_stats())
    held = [await connect(port) for _ in range(2)]
    for client in held:
        assert (await client.request(get())).status == 200
        await client.stream.send_all(b"GET /metrics HTTP/1.1\r\n")  # a head under way
    extra = await connect(port)
    reply = await extra.reply()
    assert reply.status == 503
    assert b"mid-request" in reply.body
    await held[0].stream.aclose()
    newcomer = await connect(port)
    # The closed one's place frees as soon as the server sees the close.
    while (reply := await newcomer.request(get())).status == 503:
        newcomer = await connect(port)
    assert reply.status == 200


async def test_idle_keep_alives_yield_to_a_new_scrape(nursery: trio.Nursery) -> None:
    """More idle keep-alive connections than the cap never lock a scrape out: each
    newcomer closes the longest-idle one (server.py ``MetricsServer._close_oldest_idle``)."""
    limit = server_module.MAX_CONNECTIONS
    port = await start(nursery, busy_stats())
    idlers = []
    for _ in range(limit + 8):
        client = await connect(port)
        assert (await client.request(get())).status == 200
        idlers.append(client)
    scraper = await connect(port)
    for _ in range(3):
        reply = await scraper.request(get())
        assert reply.status == 200
        assert b"tapupr_active_connections" in reply.body
    # The first ones (idle longest) were closed quietly, with no bytes; the newest live on.
    for client in idlers[:9]:
        assert await client.closed()
        assert client.buffer == b""
    assert (await idlers[-1].request(get())).status == 200


async def test_connections_that_never_send_yield_too(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 4)
    port = await start(nursery, busy_stats())
    silent = [await connect(port) for _ in range(10)]
    assert (await (await connect(port)).request(get())).status == 200
    assert await silent[0].closed()


async def test_render_failure_is_500_not_a_crash(nursery: trio.Nursery) -> None:
    class Broken:
        def collect(self) -> list[object]:
            raise RuntimeError("boom")

    registry = CollectorRegistry()
    registry.register(Broken())  # type: ignore[arg-type]
    port = await start(nursery, busy_stats(), registry=registry)
    client = await connect(port)
    reply = await client.request(get())
    assert reply.status == 500
    assert (await (await connect(port)).request(get("/"))).status == 200


async def test_injected_registry_released_on_exit() -> None:
    registry = CollectorRegistry()
    async with trio.open_nursery() as nursery:
        await start(nursery, busy_stats(), registry=registry)
        assert "tapupr_active_connections" in registry._names_to_collectors
        nursery.cancel_scope.cancel()
    assert "tapupr_active_connections" not in registry._names_to_collectors


async def test_scrapes_while_streams_churn(nursery: trio.Nursery) -> None:
    """Renders run in a thread while the trio side mutates: every scrape succeeds."""
    stats = GatewayStats()
    port = await start(nursery, stats, per_vbucket=True)
    done = trio.Event()

    async def churn() -> None:
        n = 0
        while not done.is_set():
            stream = StreamStats(UPR_FRONT, f"c{n % 7}", "node:11210")
            with stats.stream(stream):
                for vb in range(32):
                    stream.vbucket(vb).upstream_high_seqno = n + vb
                    stream.items_sent["mutation"] += 1
                await trio.sleep(0)
            n += 1

    nursery.start_soon(churn)
    client = await connect(port)
    for _ in range(10):
        reply = await client.request(get())
        assert reply.status == 200
        parse(reply.body.decode())  # well formed, no duplicate series
    done.set()


async def test_health_status_and_page_routes(nursery: trio.Nursery) -> None:
    """Without a ``Health`` (a bare metrics server) there is nothing to wait for."""
    port = await start(nursery, busy_stats())
    client = await connect(port)
    alive = await client.request(get("/healthz"))
    assert alive.status == 200 and alive.headers["content-type"] == "application/json"
    assert json.loads(alive.body)["alive"] is True
    ready = await client.request(get("/readyz"))
    assert (ready.status, json.loads(ready.body)) == (200, {"ready": True, "not_ready": []})
    doc = json.loads((await client.request(get("/status.json"))).body)
    assert [s["connection"] for s in doc["streams"]] == ["replica-1"]
    assert doc["streams"][0]["send_lag_items"] == 9
    page = await client.request(get("/"))
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert b"/status.json" in page.body and b"<script" in page.body
    assert b"http://" not in page.body and b"https://" not in page.body  # nothing external
    head = await client.request(b"HEAD /readyz HTTP/1.1\r\nHost: t\r\n\r\n", head_only=True)
    assert head.status == 200 and int(head.headers["content-length"]) > 0
    missing = await (await connect(port)).request(get("/health"))
    assert missing.status == 404 and b"/healthz" in missing.body


async def test_readyz_is_503_naming_what_is_not_ready(nursery: trio.Nursery) -> None:
    from gateway.metrics.health import Health

    health = Health()
    health.upstream("--tap-upstream", "node1:11210").record(False, "host unreachable")
    port: int = await nursery.start(lambda task_status: serve_metrics(
        busy_stats(), "127.0.0.1", 0, health=health, task_status=task_status
    ))  # fmt: skip
    client = await connect(port)
    reply = await client.request(get("/readyz"))
    assert reply.status == 503
    assert json.loads(reply.body)["not_ready"] == [
        "listeners are still being bound",
        "--tap-upstream node1:11210 is unreachable: host unreachable",
    ]
    # A 503 here is an answer, not a refusal: the connection stays open.
    assert "connection" not in reply.headers
    assert (await client.request(get("/healthz"))).status == 200


async def test_metrics_carry_readiness_and_each_checked_upstream(nursery: trio.Nursery) -> None:
    """``/readyz`` as gauges: an alert on an unreachable upstream needs no HTTP probe."""
    from gateway.metrics.health import Health

    health = Health(listeners_bound=True)
    health.upstream("--upr-upstream", "node3:11210").record(True, "answers", now=1000.0)
    down = health.upstream("--tap-upstream", "node1:11210")
    down.record(False, "connection refused", now=2000.0)
    health.upstream("--other", "node9:11210")  # not checked yet: no series
    port: int = await nursery.start(lambda task_status: serve_metrics(
        busy_stats(), "127.0.0.1", 0, health=health, task_status=task_status
    ))  # fmt: skip
    client = await connect(port)
    samples = parse((await client.request(get("/metrics"))).body.decode())
    assert value(samples, "tapupr_ready") == 0
    up = {k: v for k, v in samples.items() if k[0] == "tapupr_upstream_up"}
    assert up == {
        (
            "tapupr_upstream_up",
            frozenset({("option", "--upr-upstream"), ("upstream", "node3:11210")}),
        ): 1,
        (
            "tapupr_upstream_up",
            frozenset({("option", "--tap-upstream"), ("upstream", "node1:11210")}),
        ): 0,
    }
    since = "tapupr_upstream_state_since_seconds"
    assert value(samples, since, option="--tap-upstream", upstream="node1:11210") == 2000.0
    # It answers again: the next scrape says so, and the process is ready.
    down.record(True, "answers", now=3000.0)
    samples = parse((await client.request(get("/metrics"))).body.decode())
    assert (
        value(samples, "tapupr_upstream_up", option="--tap-upstream", upstream="node1:11210") == 1
    )
    assert value(samples, since, option="--tap-upstream", upstream="node1:11210") == 3000.0
    assert value(samples, "tapupr_ready") == 0  # --other is still unchecked
    health.upstreams.pop("--other")
    assert value(parse((await client.request(get("/metrics"))).body.decode()), "tapupr_ready") == 1
