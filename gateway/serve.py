"""``tap-upr-gateway serve``: both fronts, the metrics endpoint, and the embedded upstream.

Theory of operation. ``run_serve`` starts, in one trio nursery:

- the TAP front (old TAP clients in, a UPR upstream node behind) when a UPR
  upstream is given;
- the UPR front (UPR consumers in, a TAP upstream node behind, a durable log
  in the state directory) when a TAP upstream is given;
- the Prometheus endpoint over the ``GatewayStats`` both fronts update.

With no upstream at all it starts the embedded reference node on a free
loopback port, with sample data and a trickle of live writes, and points
both fronts at it, so that the command does something real out of the box.
It runs until cancelled or until SIGINT/SIGTERM; the fronts save their
state on the way out.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from gateway.stats import GatewayStats

log = logging.getLogger("gateway.serve")

DEFAULT_TAP_LISTEN = ("127.0.0.1", 11212)
DEFAULT_UPR_LISTEN = ("127.0.0.1", 11213)
DEFAULT_METRICS_LISTEN = ("127.0.0.1", 9464)


@dataclass
class ServeOptions:
    tap_listen: tuple[str, int] = DEFAULT_TAP_LISTEN
    upr_upstream: tuple[str, int] | None = None
    upr_listen: tuple[str, int] = DEFAULT_UPR_LISTEN
    tap_upstream: tuple[str, int] | None = None
    metrics_listen: tuple[str, int] | None = DEFAULT_METRICS_LISTEN
    per_vbucket_metrics: bool = False
    state_dir: Path | None = None
    dialect: str = "dcp"
    upstream_user: str | None = None
    upstream_password: str | None = None
    users: dict[str, str] | None = None
    fsync: str = "batch"
    capture_dir: Path | None = None
    """Record what every front connection receives and sends (``gateway.capture``)."""
    # The embedded upstream (only without --upr-upstream/--tap-upstream).
    embedded_vbuckets: int = 64
    embedded_sample_items: int = 10_000
    embedded_writes_per_second: float = 20.0


@dataclass
class Running:
    """What ``run_serve`` reports once everything listens (ports actually bound)."""

    tap_port: int | None = None
    upr_port: int | None = None
    metrics_port: int | None = None
    embedded_port: int | None = None
    state_dir: Path | None = None
    stats: GatewayStats = field(default_factory=GatewayStats)


async def run_serve(
    options: ServeOptions, *, task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED
) -> None:
    running = Running()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
        upr_upstream, tap_upstream = options.upr_upstream, options.tap_upstream
        if upr_upstream is None and tap_upstream is None:
            embedded = await nursery.start(_run_embedded_node, options)
            running.embedded_port = embedded
            upr_upstream = tap_upstream = ("127.0.0.1", embedded)
        state_dir = options.state_dir
        if state_dir is None and tap_upstream is not None:
            state_dir = Path(tempfile.mkdtemp(prefix="tap-upr-gateway-"))
            log.warning("no --state-dir given: the UPR front's log lives in %s", state_dir)
        running.state_dir = state_dir
        if upr_upstream is not None:
            running.tap_port = await nursery.start(
                _run_tap_front, options, upr_upstream, state_dir, running.stats
            )
            log.info(
                "TAP front listening on %s:%d, reading UPR from %s:%d",
                options.tap_listen[0],
                running.tap_port,
                *upr_upstream,
            )
        if tap_upstream is not None:
            assert state_dir is not None
            running.upr_port = await nursery.start(
                _run_upr_front, options, tap_upstream, state_dir, running.stats
            )
            log.info(
                "UPR front listening on %s:%d, reading TAP from %s:%d (log in %s)",
                options.upr_listen[0],
                running.upr_port,
                *tap_upstream,
                state_dir,
            )
        if options.metrics_listen is not None:
            from gateway.metrics.server import serve_metrics

            host, port = options.metrics_listen
            running.metrics_port = await nursery.start(
                lambda task_status: serve_metrics(
                    running.stats,
                    host,
                    port,
                    per_vbucket=options.per_vbucket_metrics,
                    task_status=task_status,
                )
            )
            log.info("metrics on http://%s:%d/metrics", host, running.metrics_port)
        task_status.started(running)


async def _run_tap_front(
    options: ServeOptions,
    upstream: tuple[str, int],
    state_dir: Path | None,
    stats: GatewayStats,
    *,
    task_status: trio.TaskStatus[int],
) -> None:
    from gateway.tapfront.server import TapFront, TapFrontConfig

    front = TapFront(
        TapFrontConfig(
            listen=options.tap_listen,
            upr_upstream=upstream,
            state_dir=state_dir,
            dialect=options.dialect,
            upstream_user=options.upstream_user,
            upstream_password=options.upstream_password,
            users=options.users,
            capture_dir=options.capture_dir,
        ),
        stats,
    )
    await _start(front.serve, task_status)


async def _run_upr_front(
    options: ServeOptions,
    upstream: tuple[str, int],
    state_dir: Path,
    stats: GatewayStats,
    *,
    task_status: trio.TaskStatus[int],
) -> None:
    from gateway.uprfront import UprFrontConfig, serve_upr_front

    config = UprFrontConfig(
        listen=options.upr_listen,
        tap_upstream=upstream,
        state_dir=state_dir,
        dialect=options.dialect,
        upstream_user=options.upstream_user,
        upstream_password=options.upstream_password,
        users=options.users,
        fsync=options.fsync,
        capture_dir=options.capture_dir,
    )

    async def serve(task_status: trio.TaskStatus[int]) -> None:
        await serve_upr_front(config, stats=stats, task_status=task_status)

    await _start(serve, task_status)


async def _start(serve: object, task_status: trio.TaskStatus[int]) -> None:
    """Run ``serve`` here, passing its bound port on as this task's start value."""
    async with trio.open_nursery() as nursery:
        task_status.started(await nursery.start(serve))  # type: ignore[arg-type]


async def _run_embedded_node(options: ServeOptions, *, task_status: trio.TaskStatus[int]) -> None:
    from gateway.node.main import NodeOptions, build_node
    from gateway.wire import bound_port

    node = build_node(
        NodeOptions(
            host="127.0.0.1",
            port=0,
            vbuckets=options.embedded_vbuckets,
            sample_items=options.embedded_sample_items,
            dialect=options.dialect,
        )
    )
    try:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(node.serve, "127.0.0.1", 0)
            port = bound_port(listeners)
            log.info(
                "no upstream given: serving from an embedded reference node on 127.0.0.1:%d "
                "(%d vbuckets, %d sample items, %.0f live writes/s)",
                port,
                options.embedded_vbuckets,
                options.embedded_sample_items,
                options.embedded_writes_per_second,
            )
            if options.embedded_writes_per_second > 0:
                nursery.start_soon(_trickle, node.store, options.embedded_writes_per_second)
            task_status.started(port)
    finally:
        node.store.close()


async def _trickle(store: object, per_second: float) -> None:
    """Live writes on the embedded node, so streams show changes and lag moves."""
    from adapters.mcbp.vbucket import vbucket_of

    n_vbuckets: int = store.n_vbuckets  # type: ignore[attr-defined]
    count = 0
    while True:
        await trio.sleep(1.0 / per_second)
        key = b"live::%06d" % (count % 100_000)
        count += 1
        vb = vbucket_of(key, n_vbuckets)
        store.set(vb, key, b"x" * 100, now=time.time())  # type: ignore[attr-defined]


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            scope.cancel()
            return
