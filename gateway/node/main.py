"""``tap-upr-gateway node``: run the reference node until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from gateway.cli.startup import StartupError, describe_file
from gateway.io.auth import Users
from gateway.io.limits import ConnectionLimits
from gateway.io.listen import bound_port
from gateway.node.items import VBucketState
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store
from gateway.runtime.signals import stopped_by_signals

log = logging.getLogger("gateway.node")


@dataclass
class NodeOptions:
    host: str = "127.0.0.1"
    port: int = 11210
    vbuckets: int = 64
    data_dir: Path | None = None
    fsync: str = "batch"
    max_items: int = 2_000_000
    sample_items: int = 0
    value_size: int = 100
    dialect: str = "dcp"
    users: Users | dict[str, str] | None = None
    replica_vbuckets: tuple[int, ...] = ()
    """Vbuckets that start as replicas (a move's destination); the others are active."""
    limits: ConnectionLimits = field(
        default_factory=lambda: ConnectionLimits(command_idle_timeout=None)
    )
    ssl_context: ssl.SSLContext | None = None


def build_node(options: NodeOptions) -> Node:
    store = Store(
        options.vbuckets,
        data_dir=options.data_dir,
        fsync=options.fsync,
        max_items=options.max_items,
    )
    for vb in options.replica_vbuckets:
        store.set_state(vb, VBucketState.REPLICA, now=time.time())
    if options.sample_items:
        written = store.populate_sample(
            options.sample_items, value_size=options.value_size, now=time.time()
        )
        log.info("wrote %d sample items (keys sample::NNNNNN)", written)
    config = NodeConfig(
        vbuckets=options.vbuckets,
        dialect=options.dialect,
        users=options.users,
        limits=options.limits,
        ssl_context=options.ssl_context,
    )
    return Node(store, config)


async def run_node(
    options: NodeOptions,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled or signalled; the store is closed (flushed) on the way out."""
    try:
        node = build_node(options)
    except OSError as exc:
        where = f"--data-dir {options.data_dir}" if options.data_dir else "the store"
        raise StartupError(f"{where}: {describe_file(exc)}") from None
    except ValueError as exc:  # a journal of another vbucket count or format, or damaged
        if options.data_dir is None:
            raise
        raise StartupError(
            f"--data-dir {options.data_dir}: cannot recover the store: {exc} "
            f"(--vbucket-count {options.vbuckets})"
        ) from None
    async with stopped_by_signals() as stop:
        try:
            with stop:
                async with trio.open_nursery() as nursery:
                    listeners = await nursery.start(node.serve, options.host, options.port)
                    port = bound_port(listeners)
                    log.info(
                        "reference node listening on %s:%d (%d vbuckets, dialect %s%s)",
                        options.host,
                        port,
                        options.vbuckets,
                        options.dialect,
                        f", data in {options.data_dir}" if options.data_dir else ", in memory",
                    )
                    task_status.started(port)
        finally:
            node.store.close()
            log.info("reference node stopped")
