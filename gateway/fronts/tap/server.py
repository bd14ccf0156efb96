"""The TAP front's listener: TAP clients in, one UPR upstream connection each.

Theory of operation. Every connection starts as a memcached command
connection, as on a 2.x node: SASL (required when ``users`` is set), NOOP,
VERSION, STAT (``tap``, ``tap-vbtakeover <vb> <name>``, ``upr``/``dcp`` about
its upstream UPR connections, and the upstream's vbucket groups) and
DEREGISTER_TAP_CLIENT are answered; anything else but a TAP CONNECT gets
UNKNOWN_COMMAND and the connection stays open; the same door answers them
on a streaming connection too (``TapSession.answer``). A CONNECT is decoded
(a malformed one gets NOT_SUPPORTED naming the field, and the connection
closes), the upstream's vbuckets are read with ``STAT vbucket``
and ``STAT vbucket-seqno``, the CONNECT is planned (``plan``) and a
``TapSession`` serves the connection for the rest of its life. A second
connection under a name already streaming replaces the first, as 2.x did,
unless it is a registered client: that one is refused (NOT_SUPPORTED) and
the first keeps streaming, as ep-engine 2.x's ``createTapQueue`` did.

Registered-client positions and checkpoint ends are saved to the state
directory every ``save_interval`` seconds (packed on the loop, written and
fsynced in a worker thread) and on shutdown.
"""

from __future__ import annotations

import itertools
import logging
import ssl
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from adapters import tap, upr
from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import Frame, Opcode, Status, error_response
from adapters.mcbp.constants import status_name
from adapters.tap.connect import connect_refusal
from gateway.cli.startup import describe, show
from gateway.fronts.tap.plan import UpstreamVbucket, plan_connection
from gateway.fronts.tap.registry import Registry
from gateway.fronts.tap.session import SessionConfig, TapSession
from gateway.fronts.tap.upstream import DEFAULT_NOOP_INTERVAL
from gateway.io.auth import Authenticator, Users
from gateway.io.connection import PacketConnection, RequestFailed
from gateway.io.connection import PacketConnection as McbpClient
from gateway.io.door import Door, unknown_command
from gateway.io.limits import ConnectionLimits
from gateway.io.listen import bound_port
from gateway.io.named import NamedConnections
from gateway.io.replies import error_reply, reply, send_refusal
from gateway.io.stat_replies import (
    TAP_TAKEOVER_GROUPS,
    StatError,
    UnknownStatGroup,
    dcp_group,
    takeover_arguments,
    vbucket_argument,
)
from gateway.metrics.figures import TAP_FRONT, GatewayStats
from gateway.runtime import logs
from gateway.runtime.version import version

log = logging.getLogger(__name__)

LABEL = "tap-front"
UPSTREAM_QUERY_TIMEOUT = 10.0
UPSTREAM_STAT_GROUPS = frozenset({"vbucket", "vbucket-seqno"})


def upstream_trouble(address: tuple[str, int], exc: BaseException) -> str:
    """Why the UPR upstream could not be used, naming it, for a client and the log."""
    where = show(address)
    if isinstance(exc, trio.TooSlowError):
        return f"UPR upstream {where} is unreachable: no answer in {UPSTREAM_QUERY_TIMEOUT:g} s"
    if isinstance(exc, OSError):
        return f"UPR upstream {where} is unreachable: {describe(exc, address[0])}"
    return f"UPR upstream {where} failed: {exc}"


@dataclass
class TapFrontConfig:
    listen: tuple[str, int]
    upr_upstream: tuple[str, int]
    state_dir: Path | None = None
    dialect: str = "dcp"
    upstream_user: str | None = None
    upstream_password: str | None = None
    users: Users | dict[str, str] | None = None
    """SASL PLAIN credentials TAP clients must present (None: no authentication)."""
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    ssl_context: ssl.SSLContext | None = None
    """Serve TLS (None: plain TCP)."""
    upstream_ssl: ssl.SSLContext | None = None
    """TLS to the UPR upstream (None: plain TCP)."""
    buffer_size: int = 8 * 1024 * 1024
    ack_interval: int = 1000
    max_unacked: int = 10_000
    backoff: float = 5.0
    noop_interval: float = 20.0
    upstream_noop_interval: int = DEFAULT_NOOP_INTERVAL
    """Seconds between the upstream's NOOPs, which the front asks for (3.0 CONTROL)."""
    save_interval: float = 1.0
    reconnect_attempts: int | None = None
    capture_dir: Path | None = None

    def session_config(self) -> SessionConfig:
        return SessionConfig(
            upstream=self.upr_upstream,
            dialect=upr.get_dialect(self.dialect),
            user=self.upstream_user,
            password=self.upstream_password,
            buffer_size=self.buffer_size,
            ack_interval=self.ack_interval,
            max_unacked=self.max_unacked,
            backoff=self.backoff,
            noop_interval=self.noop_interval,
            upstream_noop_interval=self.upstream_noop_interval,
            reconnect_attempts=self.reconnect_attempts,
            capture_dir=self.capture_dir,
            ssl_context=self.upstream_ssl,
        )


async def read_upstream_vbuckets(
    address: tuple[str, int],
    user: str | None,
    password: str | None,
    ssl_context: ssl.SSLContext | None = None,
) -> dict[int, UpstreamVbucket]:
    """Each upstream vbucket's state, uuid and high seqno."""
    with trio.fail_after(UPSTREAM_QUERY_TIMEOUT):
        async with await McbpClient.connect(
            *address, name="upstream stats", ssl_context=ssl_context
        ) as client:
            if user is not None:
                await client.sasl_plain(user, password or "")
            states = await client.stats("vbucket")
            seqnos = await client.stats("vbucket-seqno")
    out = {}
    for key, state in states.items():
        if not key.startswith("vb_"):
            continue
        vb = int(key[3:])
        out[vb] = UpstreamVbucket(
            vb,
            active=state == "active",
            uuid=int(seqnos.get(f"vb_{vb}:uuid", "0")),
            high_seqno=int(seqnos.get(f"vb_{vb}:high_seqno", "0")),
        )
    return out


class TapFront:
    def __init__(
        self,
        config: TapFrontConfig,
        stats: GatewayStats | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.config = config
        self.stats = stats or GatewayStats()
        self.registry = registry or Registry.open(config.state_dir, self.stats)
        self.users = Users.of(config.users)
        self.sessions: NamedConnections[TapSession] = NamedConnections("TAP front")
        self._anonymous = itertools.count(1)
        self.door = Door(
            LABEL,
            self.users,
            config.limits,
            self.stats.listeners,
            f"tap-upr-gateway {version()} (TAP front)",
            self.stat_pairs,
            stream_opcodes=frozenset({tap.TapOpcode.CONNECT}),
            begin_stream=self._stream,
            command=self._command,
            stray_response="a response before any stream",
            on_stray_response=self._count_malformed,
        )

    def _count_malformed(self) -> None:
        self.stats.protocol_errors_total["tap_front", "malformed"] += 1

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        host, port = self.config.listen
        try:
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(
                    partial(
                        self.door.listen,
                        host,
                        port,
                        ssl_context=self.config.ssl_context,
                    )
                )
                nursery.start_soon(self._save_periodically)
                task_status.started(bound_port(listeners))
        finally:
            self.registry.save(clean=True)

    async def _save_periodically(self) -> None:
        while True:
            await trio.sleep(self.config.save_interval)
            data = self.registry.image()
            if data is not None:
                await trio.to_thread.run_sync(self.registry.write, data)

    # -- one connection ------------------------------------------------------

    async def _command(self, conn: PacketConnection, frame: Frame, auth: Authenticator) -> None:
        if frame.opcode != Opcode.DEREGISTER_TAP_CLIENT:
            await unknown_command(conn, frame, auth)
        elif not auth.may_administer():
            message = auth.refuse_admin("DEREGISTER_TAP_CLIENT")
            await conn.send(error_reply(frame, Status.AUTH_ERROR, message))
        else:
            name = frame.key.decode("utf-8", "replace")
            self.registry.forget(name)
            self.sessions.close(name)
            await conn.send(reply(frame))

    async def stat_pairs(self, group: str) -> list[tuple[str, str]]:
        """``STAT tap`` and ``tap-vbtakeover`` from the gateway's own figures,
        ``upr``/``dcp`` about the front's upstream UPR connections; the vbucket
        groups, which TAP tools read to pick their vbuckets, from the upstream
        node as it answers them. A refusal raises ``StatError`` saying why."""
        from gateway.metrics.stat_groups import tap_stat_pairs

        name, *args = group.split() or [""]
        if name in ("", "tap"):
            return tap_stat_pairs(self.stats)
        if name in TAP_TAKEOVER_GROUPS:
            return self._takeover_pairs(name, args)
        if name in ("upr", "dcp"):
            return self._upstream_dcp_pairs()
        if name not in UPSTREAM_STAT_GROUPS:
            served = {"tap", "upr", "dcp", *TAP_TAKEOVER_GROUPS, *UPSTREAM_STAT_GROUPS}
            known = ", ".join(sorted(served))
            raise UnknownStatGroup(f"unknown stat group {name!r} (known: {known})")
        config = self.config
        try:
            with trio.fail_after(UPSTREAM_QUERY_TIMEOUT):
                async with await McbpClient.connect(
                    *config.upr_upstream, ssl_context=config.upstream_ssl
                ) as client:
                    if config.upstream_user is not None:
                        await client.sasl_plain(
                            config.upstream_user, config.upstream_password or ""
                        )
                    return list((await client.stats(group)).items())
        except RequestFailed as exc:
            # The upstream's own answer (e.g. a vbucket it does not have), passed on.
            where = show(config.upr_upstream)
            detail = exc.text.decode("utf-8", "replace") or status_name(exc.status)
            raise StatError(f"UPR upstream {where}: {detail}", exc.status) from None
        except (OSError, GatewayError, trio.TooSlowError) as exc:
            message = upstream_trouble(config.upr_upstream, exc)
            log.warning("STAT %s: %s", group, message)
            raise StatError(message, Status.TEMPORARY_FAILURE) from None

    def _takeover_pairs(self, group: str, args: list[str]) -> list[tuple[str, str]]:
        """``tap-vbtakeover <vb> <name>`` (ep-engine v2.5.1 src/ep_engine.cc
        ``doTapVbTakeoverStats``): what that TAP connection has still to send."""
        vb_arg, name = takeover_arguments(group, args)
        session = self.sessions.get(name)
        progress = session.stats.vbuckets.get(int(vb_arg)) if vb_arg.isdigit() and session else None
        if progress is None:
            vbucket_argument(vb_arg, lambda _vb: True)  # EINVAL if not a number
            raise StatError(f"no TAP stream named {name!r} on vbucket {vb_arg}")
        backfill = progress.backfill_remaining
        return [
            ("name", f"eq_tapq:{name}"),
            ("status", "backfilling" if progress.backfilling else "in-memory"),
            ("estimate", str(progress.lag_sent)),
            ("backfill_remaining", str(backfill)),
            ("chk_items", str(max(0, progress.lag_sent - backfill))),
        ]

    def _upstream_dcp_pairs(self) -> list[tuple[str, str]]:
        """``STAT dcp``: each TAP client's UPR connection to the upstream node,
        where the front is the consumer (what it has sent is the TAP side's)."""
        sessions = sorted(self.stats.active(TAP_FRONT), key=lambda s: s.connection)
        totals = [
            ("count", len(sessions)),
            ("producer_count", 0),
            ("consumer_count", len(sessions)),
            ("total_bytes", 0),
            ("items_sent", 0),
            ("items_remaining", 0),
        ]
        per_connection: list[tuple[str, str]] = []
        for fig in sessions:
            values: list[tuple[str, object]] = [
                ("type", "consumer"),
                ("upstream", fig.upstream),
                ("created", int(fig.created)),
                ("max_buffer_bytes", fig.buffer_size),
                ("unacked_bytes", fig.unacked_bytes),
                ("num_streams", len(fig.vbuckets)),
            ]
            per_connection += [(f"{fig.connection}:{k}", str(v)) for k, v in values]
        return dcp_group(totals, per_connection)

    async def _stream(self, conn: PacketConnection, frame: Frame, auth: Authenticator) -> bool:
        """Serve a TAP CONNECT for the rest of the connection's life."""
        logs.name_connection(frame.key.decode("utf-8", "replace"))
        conn.streaming()
        try:
            connect = tap.decode_frame(frame)
        except ProtocolError as exc:
            self.stats.protocol_errors_total["tap_front", "malformed_connect"] += 1
            await send_refusal(conn, error_reply(frame, Status.NOT_SUPPORTED, str(exc)))
            raise
        assert isinstance(connect, tap.TapConnect)
        if connect.connect_flags & tap.ConnectFlags.TAKEOVER_VBUCKETS and not auth.may_administer():
            denied = ProtocolError(
                auth.refuse_admin("TAP takeover"), opcode=frame.opcode, status=Status.AUTH_ERROR
            )
            await send_refusal(conn, error_response(frame, denied))
            raise denied
        config = self.config
        name = connect.name.decode("utf-8", "replace") or f"anon_{next(self._anonymous)}"
        try:
            upstream = await read_upstream_vbuckets(
                config.upr_upstream,
                config.upstream_user,
                config.upstream_password,
                config.upstream_ssl,
            )
        except (OSError, GatewayError, trio.TooSlowError) as exc:
            failure = ProtocolError(
                upstream_trouble(config.upr_upstream, exc),
                opcode=frame.opcode,
                status=Status.TEMPORARY_FAILURE,
            )
            await send_refusal(conn, error_response(frame, failure))
            raise failure from None
        registry = self.registry
        registered = connect.connect_flags & tap.ConnectFlags.REGISTERED_CLIENT
        if registered and self.sessions.holds(name):
            # As 2.x: a registered name that is streaming is refused; the first goes on.
            # No checkpoint from here to ``running``, so two cannot both pass.
            self.stats.protocol_errors_total["tap_front", "refused_connect"] += 1
            taken = connect_refusal(
                f"TAP client {name!r} is already connected", field="key", value=connect.name
            )
            await send_refusal(conn, error_response(frame, taken))
            raise taken
        try:
            plan = plan_connection(
                connect,
                name,
                upstream,
                registered=registry.positions(name) if registered else None,
                checkpoint_ends=registry.checkpoint_ends(),
                now=time.time(),
            )
        except ProtocolError as exc:
            self.stats.protocol_errors_total["tap_front", "refused_connect"] += 1
            await send_refusal(conn, error_response(frame, exc))
            raise
        if plan.registered:
            registry.register(name)
        session = TapSession(
            conn, plan, config.session_config(), registry, self.stats, answer=self.door.answer
        )
        log.info(
            "%s: TAP stream of %d vbuckets (flags 0x%x) from UPR upstream %s:%d",
            name,
            len(plan.starts),
            int(plan.flags),
            *config.upr_upstream,
        )
        with self.sessions.running(name, session):
            await session.run()
        return True
