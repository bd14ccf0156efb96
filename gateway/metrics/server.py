"""``/metrics`` over HTTP/1.1 on trio, rendered off the event loop; beside it
``/healthz`` and ``/readyz`` (``gateway.metrics.health``), ``/status.json``
(``gateway.metrics.status``) and the status page at ``/`` (``status.html``).

Each scrape captures a ``StatsView`` on the trio thread (a copy of the stream
list and process counters: cheap, and consistent with the fronts, which
mutate the stats on that thread), then renders the text in a worker thread,
one render at a time, so a scrape of thousands of streams never stalls them.

The exposition format follows the Accept header (Prometheus text, or
OpenMetrics when asked for; ``prometheus_client``'s ``choose_encoder``) and
the body is gzipped when the scraper accepts it. Connections are bounded in
number, in request-head size and in time (idle, head and write timeouts);
bad requests get a specific 4xx/5xx and a closed connection (see
``gateway.metrics.http``). At the connection cap, a new connection closes
the longest-idle keep-alive connection instead of being refused, so idle
scrapers (or anyone holding sockets open) never lock a scrape out; only when
every connection is in the middle of a request does a new one get 503.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from functools import cache
from importlib import resources

import trio
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder

from gateway.metrics.collector import Clock, GatewayCollector, register_gateway_metrics
from gateway.metrics.families import Family, gateway_families, health_families
from gateway.metrics.figures import GatewayStats
from gateway.metrics.health import Health
from gateway.metrics.http import (
    MAX_HEAD_BYTES,
    HttpError,
    Request,
    accepts_gzip,
    error_response,
    find_head_end,
    parse_request_head,
    response,
)
from gateway.metrics.render import OPENMETRICS_CONTENT_PREFIX, render
from gateway.metrics.status import BackfillTracker, status_json
from gateway.metrics.view import StatsView
from gateway.runtime.version import version

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
MAX_REQUESTS_PER_CONNECTION = 1000
IDLE_TIMEOUT = 30.0
"""Keeps a 15 s scraper's connection; longer idlers are closed (and yield at the cap anyway)."""
HEAD_TIMEOUT = 10.0
WRITE_TIMEOUT = 30.0
CLOSE_TIMEOUT = 2.0
RECEIVE_SIZE = 16384
LINGER_TIMEOUT = 1.0
LINGER_BYTES = 1 << 20
GZIP_LEVEL = 1
"""Fast: metrics text compresses well even at the lowest level."""

PAGES = ("/", "/metrics", "/healthz", "/readyz", "/status.json")
JSON = "application/json"
NO_STORE = (("Cache-Control", "no-store"),)


@cache
def status_page() -> bytes:
    """The status page (one self-contained file: no CDN, no build step)."""
    return resources.files("gateway.metrics").joinpath("status.html").read_bytes()


async def _linger(stream: trio.abc.Stream) -> None:
    """Half-close, then drain what the peer still sends, so closing with unread
    input does not reset the connection before the peer reads our error."""
    if isinstance(stream, trio.abc.HalfCloseableStream):
        await stream.send_eof()
    with trio.move_on_after(LINGER_TIMEOUT):
        drained = 0
        while drained < LINGER_BYTES:
            data = await stream.receive_some(RECEIVE_SIZE)
            if not data:
                return
            drained += len(data)


class MetricsServer:
    """Answers HTTP requests for one registry (``handle`` per TCP connection)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        collector: GatewayCollector,
        health: Health | None = None,
    ) -> None:
        self.registry = registry
        self.collector = collector
        self.health = health
        self.backfills = BackfillTracker()
        self.render_limiter = trio.CapacityLimiter(1)
        self.scrapes_total = 0
        self.idle_closed_total = 0
        """Keep-alive connections closed to make room for a new one."""
        self._open: set[object] = set()
        self._idle: dict[object, trio.CancelScope] = {}
        """Connections waiting for their next request, the longest-waiting first."""

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def _close_oldest_idle(self) -> bool:
        """Make room: end the longest-idle connection's wait (it closes quietly)."""
        if not self._idle:
            return False
        token, scope = next(iter(self._idle.items()))
        del self._idle[token]
        self._open.discard(token)
        scope.cancel()
        self.idle_closed_total += 1
        return True

    async def handle(self, stream: trio.abc.Stream) -> None:
        token = object()
        try:
            if len(self._open) >= MAX_CONNECTIONS and not self._close_oldest_idle():
                busy = HttpError(503, f"all {MAX_CONNECTIONS} connections are mid-request")
                with trio.move_on_after(WRITE_TIMEOUT):
                    await stream.send_all(error_response(busy))
                await _linger(stream)
                return
            self._open.add(token)
            try:
                await self._serve(stream, token)
            finally:
                self._open.discard(token)
                self._idle.pop(token, None)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the scraper went away; nothing to answer
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT) as scope:
                scope.shield = True
                await stream.aclose()

    async def _serve(self, stream: trio.abc.Stream, token: object) -> None:
        buffer = bytearray()
        for served in range(1, MAX_REQUESTS_PER_CONNECTION + 1):
            try:
                request = await self._read_request(stream, buffer, token)
            except HttpError as error:
                with trio.move_on_after(WRITE_TIMEOUT):
                    await stream.send_all(error_response(error))
                await _linger(stream)
                return
            if request is None:
                return
            close = not request.keep_alive or served == MAX_REQUESTS_PER_CONNECTION
            reply, must_close = await self.answer(request, close=close)
            with trio.move_on_after(WRITE_TIMEOUT) as scope:
                await stream.send_all(reply)
            if scope.cancelled_caught or close or must_close:
                if must_close:
                    await _linger(stream)
                return

    async def _read_request(
        self, stream: trio.abc.Stream, buffer: bytearray, token: object
    ) -> Request | None:
        """The next request head, or ``None`` at a clean close, an idle timeout, or
        when a new connection needed this one's place while it was idle."""
        deadline = trio.current_time() + (HEAD_TIMEOUT if buffer else IDLE_TIMEOUT)
        while True:
            end = find_head_end(buffer)
            if end >= 0 or len(buffer) > MAX_HEAD_BYTES:
                if end < 0 or end > MAX_HEAD_BYTES:
                    raise HttpError(431, f"request head over {MAX_HEAD_BYTES} bytes")
                head = bytes(buffer[:end])
                del buffer[:end]
                return parse_request_head(head)
            with trio.move_on_at(deadline) as scope:
                if not buffer.strip():
                    self._idle[token] = scope
                try:
                    data = await stream.receive_some(RECEIVE_SIZE)
                finally:
                    self._idle.pop(token, None)
            if scope.cancelled_caught:
                if buffer.strip():
                    raise HttpError(408, f"request head not complete in {HEAD_TIMEOUT:g} s")
                return None
            if not data:
                return None  # closed (perhaps mid-head): no one left to answer
            if not buffer.strip():
                deadline = min(deadline, trio.current_time() + HEAD_TIMEOUT)
            buffer += data

    async def answer(self, request: Request, *, close: bool) -> tuple[bytes, bool]:
        """The response bytes, and whether the connection must close after them."""
        head_only = request.method == "HEAD"
        try:
            if request.path not in PAGES:
                pages = ", ".join(PAGES)
                raise HttpError(404, f"no page {request.path[:100]!r}; pages: {pages}")
            if request.method not in ("GET", "HEAD"):
                raise HttpError(405, f"method {request.method} on {request.path}")
        except HttpError as error:
            return error_response(error, head_only=head_only), True
        if request.path != "/metrics":
            return await self._other_page(request.path, head_only=head_only, close=close)
        view = self.collector.capture()
        extra = [] if self.health is None else health_families(self.health)
        use_gzip = accepts_gzip(request.header("accept-encoding"))
        try:
            body, content_type = await trio.to_thread.run_sync(
                self._render, view, extra, request.header("accept"), use_gzip,
                limiter=self.render_limiter,
            )  # fmt: skip
        except Exception:
            log.exception("rendering /metrics failed")
            failed = HttpError(500, "rendering the metrics failed; see the gateway's log")
            return error_response(failed, head_only=head_only), True
        self.scrapes_total += 1
        headers = [("Vary", "Accept, Accept-Encoding")]
        if use_gzip:
            headers.append(("Content-Encoding", "gzip"))
        reply = response(
            200, body, content_type=content_type, headers=tuple(headers),
            head_only=head_only, close=close,
        )  # fmt: skip
        return reply, False

    async def _other_page(self, path: str, *, head_only: bool, close: bool) -> tuple[bytes, bool]:
        status = 200
        content_type = JSON
        if path == "/":
            body, content_type = status_page(), "text/html; charset=utf-8"
        elif path == "/healthz":
            # Answering at all is the proof: the event loop runs.
            body = json.dumps({"alive": True, "version": version()}).encode()
        elif path == "/readyz":
            ready = {"ready": True, "not_ready": []} if self.health is None else (
                self.health.readiness()
            )  # fmt: skip
            status = 200 if ready["ready"] else 503
            body = json.dumps(ready).encode()
        else:
            view = self.collector.capture()
            health = None if self.health is None else self.health.snapshot(view.now)
            try:
                body = await trio.to_thread.run_sync(
                    status_json, view, health, self.backfills, limiter=self.render_limiter
                )
            except Exception:
                log.exception("building /status.json failed")
                failed = HttpError(500, "building the status failed; see the gateway's log")
                return error_response(failed, head_only=head_only), True
        reply = response(
            status, body, content_type=content_type, headers=NO_STORE,
            head_only=head_only, close=close,
        )  # fmt: skip
        return reply, False

    def _render(
        self, view: StatsView, extra: list[Family], accept: str, use_gzip: bool
    ) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        openmetrics = content_type.startswith(OPENMETRICS_CONTENT_PREFIX)
        # The gateway's families directly; the registry's other collectors as usual.
        ours = gateway_families(view, per_vbucket=self.collector.per_vbucket) + extra
        with self.collector.pinned(view, skip=True):
            rest = encoder(self.registry)
        body = render(ours, openmetrics=openmetrics) + rest
        if use_gzip:
            body = gzip.compress(body, compresslevel=GZIP_LEVEL)
        return body, content_type


async def serve_metrics(
    stats: GatewayStats,
    host: str,
    port: int,
    *,
    per_vbucket: bool = False,
    registry: CollectorRegistry | None = None,
    clock: Clock = time.time,
    health: Health | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/metrics`` for ``stats`` on ``host:port`` (0: a free port) until cancelled,
    with ``/healthz``, ``/readyz`` (from ``health``), ``/status.json`` and the status
    page at ``/``.

    ``task_status.started`` receives the bound port. Without ``registry`` a
    fresh one is made, with the process collector (CPU, memory, open files)
    beside the gateway's; an injected one gets the gateway collector added
    for as long as this runs.
    """
    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
    collector = register_gateway_metrics(registry, stats, per_vbucket=per_vbucket, clock=clock)
    try:
        server = MetricsServer(registry, collector, health)
        listeners = await trio.open_tcp_listeners(port, host=host)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, server.handle, listeners)
            bound: int = listeners[0].socket.getsockname()[1]
            task_status.started(bound)
    finally:
        registry.unregister(collector)
