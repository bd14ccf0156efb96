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

import contextlib
import logging
import os
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from gateway.cli.startup import (
    lock_directory,
    prepare_directory,
    show,
    start_listener,
    watch_upstream,
)
from gateway.io.auth import Users
from gateway.io.limits import ConnectionLimits
from gateway.metrics.figures import TAP_FRONT, UPR_FRONT, GatewayStats
from gateway.metrics.health import FrontInfo, Health
from gateway.runtime.loop_watch import LoopWatch, freeze_startup_objects
from gateway.runtime.signals import stopped_by_signals
from gateway.runtime.version import describe

log = logging.getLogger("gateway.cli.serve")

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
    users: Users | dict[str, str] | None = None
    fsync: str = "batch"
    capture_dir: Path | None = None
    """Record what every front connection receives and sends (``gateway.tools.capture``)."""
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    tls: ssl.SSLContext | None = None
    """Serve both fronts over TLS (None: plain TCP)."""
    upstream_tls: ssl.SSLContext | None = None
    """Connect to the upstream nodes over TLS (None: plain TCP)."""
    upstream_noop_interval: int | None = None
    """Seconds between the UPR upstream's NOOPs on the TAP front (None: its default)."""
    # The embedded upstream (only without --upr-upstream/--tap-upstream).
    embedded_vbuckets: int = 64
    embedded_sample_items: int = 10_000
    embedded_writes_per_second: float = 20.0
    freeze_gc: bool = False
    """``gc.freeze`` once everything listens (the command does; a process that
    hosts other work, such as a test run, keeps its collector as it was)."""


@dataclass
class Running:
    """What ``run_serve`` reports once everything listens (ports actually bound)."""

    tap_port: int | None = None
    upr_port: int | None = None
    metrics_port: int | None = None
    embedded_port: int | None = None
    state_dir: Path | None = None
    stats: GatewayStats = field(default_factory=GatewayStats)
    health: Health = field(default_factory=Health)


async def run_serve(
    options: ServeOptions, *, task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED
) -> None:
    """Bind every listener, then announce them; a listener that cannot bind raises
    ``StartupError`` naming its option before anything is announced."""
    running = Running()
    watch = LoopWatch()
    serving = False
    log.info("%s starting (pid %d): %s", describe(), os.getpid(), _plan(options))
    async with stopped_by_signals() as stop:
        with stop, contextlib.ExitStack() as cleanup:
            try:
                async with trio.open_nursery() as nursery:
                    announced = await _start_all(options, running, nursery, cleanup)
                    running.health.listeners_bound = True
                    if options.freeze_gc:
                        frozen = freeze_startup_objects()
                        log.debug("%d start-up objects exempted from garbage collection", frozen)
                    nursery.start_soon(watch.run)
                    serving = True
                    log.info("%s serving", describe())
                    for line in announced:
                        log.info("%s", line)
                    task_status.started(running)
            finally:
                if serving:
                    log.info("%s", watch.summary())


def _plan(options: ServeOptions) -> str:
    """What this run reads from and where it keeps state, for the first log line."""
    parts = []
    if options.upr_upstream is not None:
        parts.append(f"TAP front from --upr-upstream {show(options.upr_upstream)}")
    if options.tap_upstream is not None:
        parts.append(f"UPR front from --tap-upstream {show(options.tap_upstream)}")
    if not parts:
        parts.append("both fronts from an embedded reference node")
    if options.state_dir is not None:
        parts.append(f"state in --state-dir {options.state_dir.resolve()}")
    else:
        parts.append("no --state-dir (nothing kept across restarts)")
    return "; ".join(parts)


async def _start_all(
    options: ServeOptions,
    running: Running,
    nursery: trio.Nursery,
    cleanup: contextlib.ExitStack,
) -> list[str]:
    upr_upstream, tap_upstream = options.upr_upstream, options.tap_upstream
    health = running.health
    if upr_upstream is None and tap_upstream is None:
        embedded = await nursery.start(_run_embedded_node, options)
        running.embedded_port = embedded
        upr_upstream = tap_upstream = ("127.0.0.1", embedded)
        watched = [("embedded node", upr_upstream)]
    else:
        watched = [
            (option, upstream)
            for option, upstream in (
                ("--upr-upstream", upr_upstream),
                ("--tap-upstream", tap_upstream),
            )
            if upstream is not None
        ]
    for option, upstream in watched:
        state = health.upstream(option, show(upstream))
        # Over TLS the check stays at TCP (the handshake is the fronts' own).
        probe = options.upstream_tls is None
        nursery.start_soon(partial(watch_upstream, option, upstream, health=state, probe=probe))
    upr_option, tap_option = (
        ("embedded node", "embedded node") if running.embedded_port else
        ("--upr-upstream", "--tap-upstream")
    )  # fmt: skip
    if options.capture_dir is not None:
        prepare_directory("--capture-dir", options.capture_dir)
    state_dir = options.state_dir
    if state_dir is not None:
        prepare_directory("--state-dir", state_dir)
        cleanup.enter_context(lock_directory("--state-dir", state_dir))
    elif tap_upstream is not None:
        temporary = tempfile.TemporaryDirectory(prefix="tap-upr-gateway-")
        cleanup.enter_context(temporary)
        state_dir = Path(temporary.name)
        # Only news when the upstream is real: the embedded node keeps nothing either.
        log.log(
            logging.INFO if running.embedded_port else logging.WARNING,
            "no --state-dir given: the UPR front's log lives in %s and is removed on exit",
            state_dir,
        )
    running.state_dir = state_dir
    announced: list[str] = []
    if upr_upstream is not None:
        running.tap_port = await start_listener(
            "--tap-listen",
            options.tap_listen,
            partial(nursery.start, _run_tap_front, options, upr_upstream, state_dir, running.stats),
        )
        announced.append(
            f"TAP front listening on {options.tap_listen[0]}:{running.tap_port}, "
            f"reading UPR from {show(upr_upstream)}"
        )
        listen = f"{options.tap_listen[0]}:{running.tap_port}"
        upstream_state = health.upstreams[upr_option]
        health.fronts.append(FrontInfo(TAP_FRONT, "TAP front", listen, upstream_state))
    if tap_upstream is not None:
        assert state_dir is not None
        health.logs_proven = False
        health.upr_log = running.stats.upr_log
        running.upr_port = await start_listener(
            "--upr-listen",
            options.upr_listen,
            partial(nursery.start, _run_upr_front, options, tap_upstream, state_dir, running.stats),
        )
        announced.append(
            f"UPR front listening on {options.upr_listen[0]}:{running.upr_port}, "
            f"reading TAP from {show(tap_upstream)} (log in {state_dir})"
        )
        health.logs_proven = True  # the front proves its logs before it listens
        health.logs_set_aside = sum(running.stats.upr_log.logs_set_aside_total.values())
        listen = f"{options.upr_listen[0]}:{running.upr_port}"
        upstream_state = health.upstreams[tap_option]
        health.fronts.append(FrontInfo(UPR_FRONT, "UPR front", listen, upstream_state))
    if options.metrics_listen is not None:
        from gateway.metrics.server import serve_metrics

        host, port = options.metrics_listen
        running.metrics_port = await start_listener(
            "--metrics-listen",
            options.metrics_listen,
            partial(
                nursery.start,
                partial(
                    serve_metrics,
                    running.stats,
                    host,
                    port,
                    per_vbucket=options.per_vbucket_metrics,
                    health=health,
                ),
            ),
        )
        base = f"http://{host}:{running.metrics_port}"
        announced.append(f"metrics on {base}/metrics, status page {base}/, health {base}/readyz")
    return announced


async def _run_tap_front(
    options: ServeOptions,
    upstream: tuple[str, int],
    state_dir: Path | None,
    stats: GatewayStats,
    *,
    task_status: trio.TaskStatus[int],
) -> None:
    from gateway.fronts.tap.server import TapFront, TapFrontConfig
    from gateway.fronts.tap.upstream import DEFAULT_NOOP_INTERVAL

    # (None: the front's default; the option refuses 0)
    noop_interval = options.upstream_noop_interval or DEFAULT_NOOP_INTERVAL
    front = TapFront(
        TapFrontConfig(
            listen=options.tap_listen,
            upstream_noop_interval=noop_interval,
            upr_upstream=upstream,
            state_dir=state_dir,
            dialect=options.dialect,
            upstream_user=options.upstream_user,
            upstream_password=options.upstream_password,
            users=options.users,
            capture_dir=options.capture_dir,
            limits=options.limits,
            ssl_context=options.tls,
            upstream_ssl=options.upstream_tls,
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
    from gateway.fronts.upr import UprFrontConfig, serve_upr_front

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
        limits=options.limits,
        ssl_context=options.tls,
        upstream_ssl=options.upstream_tls,
    )

    async def serve(task_status: trio.TaskStatus[int]) -> None:
        await serve_upr_front(config, stats=stats, task_status=task_status)

    await _start(serve, task_status)


async def _start(serve: object, task_status: trio.TaskStatus[int]) -> None:
    """Run ``serve`` here, passing its bound port on as this task's start value."""
    async with trio.open_nursery() as nursery:
        task_status.started(await nursery.start(serve))  # type: ignore[arg-type]


async def _run_embedded_node(options: ServeOptions, *, task_status: trio.TaskStatus[int]) -> None:
    from gateway.io.listen import bound_port
    from gateway.node.main import NodeOptions, build_node

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
