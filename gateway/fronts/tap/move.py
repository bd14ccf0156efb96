"""Push mode: vbuckets streamed from a UPR node into a TAP receiver (a 2.x node).

``move_upr_to_tap`` does what ns_server's 2.x vbucket mover did, with a UPR
node as the source: it makes each vbucket a replica on the destination
(SET_VBUCKET), connects to the destination as a TAP sender and runs a
``TapSession`` whose plan is backfill + support-ack + list vbuckets (+
takeover), without CHECKPOINT: after each backfill the items come alone, as
to any TAP client that did not ask for checkpoints. Without takeover each
vbucket is streamed up to the source's high seqno at the start; with
takeover the source streams until it has handed the vbucket over (pending,
dead on the source, active), which the destination acknowledges through
the TAP acks. Either way the session ends with OPAQUE(CLOSE_TAP_STREAM)
asking for an ack, and returns once it is acked: everything before it has
been applied on the destination.
"""

from __future__ import annotations

import logging
import ssl

from adapters.errors import GatewayError
from adapters.tap import ConnectFlags, OpaqueCode, TapOpaque
from gateway.fronts.moves import DestinationRefused, prepare_move_destination
from gateway.fronts.tap.plan import ConnectionPlan, VbStart
from gateway.fronts.tap.registry import Registry
from gateway.fronts.tap.server import read_upstream_vbuckets
from gateway.fronts.tap.session import SessionConfig, TapSession
from gateway.io.connection import PacketConnection, run_connection
from gateway.io.tls import open_stream
from gateway.metrics.figures import GatewayStats

log = logging.getLogger(__name__)


class MoveFailed(GatewayError):
    """The move could not be completed; the message says where it stopped."""


async def move_upr_to_tap(
    source: tuple[str, int],
    destination: tuple[str, int],
    vbuckets: list[int],
    *,
    takeover: bool,
    config: SessionConfig | None = None,
    stats: GatewayStats | None = None,
    name: str = "move",
    destination_ssl: ssl.SSLContext | None = None,
) -> GatewayStats:
    """Move ``vbuckets`` (see the module docstring); the move's figures on success.
    The source is reached over TLS when ``config.ssl_context`` is set, the
    destination when ``destination_ssl`` is."""
    config = config or SessionConfig(upstream=source)
    stats = stats or GatewayStats()
    upstream = await read_upstream_vbuckets(
        source, config.user, config.password, ssl_context=config.ssl_context
    )
    for vb in vbuckets:
        state = upstream.get(vb)
        if state is None or not state.active:
            raise MoveFailed(f"vbucket {vb} is not active on the source {source[0]}:{source[1]}")
    async with await PacketConnection.connect(
        *destination, name="move destination", ssl_context=destination_ssl
    ) as client:
        try:
            await prepare_move_destination(client, vbuckets)
        except DestinationRefused as exc:
            raise MoveFailed(str(exc)) from None
    flags = ConnectFlags.BACKFILL | ConnectFlags.SUPPORT_ACK | ConnectFlags.LIST_VBUCKETS
    if takeover:
        flags |= ConnectFlags.TAKEOVER_VBUCKETS
    starts = tuple(
        VbStart.full(vb) if takeover else VbStart.full(vb, end=upstream[vb].high_seqno)
        for vb in vbuckets
    )
    plan = ConnectionPlan(name, flags, starts)
    outcome: list[TapSession] = []

    async def push(conn: object) -> None:
        session = TapSession(
            conn,  # type: ignore[arg-type]
            plan,
            config,
            Registry(),
            stats,
            closing_messages=(TapOpaque(OpaqueCode.CLOSE_TAP_STREAM),),
        )
        outcome.append(session)
        await session.run()

    try:
        stream = await open_stream(*destination, destination_ssl)
    except OSError as exc:
        raise MoveFailed(f"cannot connect to the TAP destination: {exc}") from None
    label = "move to {}:{}".format(*destination)
    await run_connection(stream, push, name=label)
    if not outcome or not outcome[0].done:
        raise MoveFailed(f"{label}: the TAP stream ended before the destination acked it all")
    log.info("%s: vbuckets %s moved%s", label, vbuckets, " (takeover)" if takeover else "")
    return stats
