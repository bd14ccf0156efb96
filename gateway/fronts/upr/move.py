"""Move vbuckets from a TAP node into a UPR node, through the UPR front.

Theory of operation (the 3.0 UPR design's "VBucket Move (3.x)" sequence:
handshake, catch-up, takeover, with the gateway as the producer and this
command as ns_server's ebucketmigrator). ``move_tap_to_upr`` runs a UPR
front of its own (ingest from the TAP node into ``state_dir``, a listener
on a loopback port) and plays the orchestrator's part:

1. it opens a producer connection on the gateway and a consumer connection
   (OPEN with no flags) on the destination, under one name;
2. per vbucket, ADD_STREAM on the destination (with TAKEOVER when asked);
   the destination answers and sends its own STREAM_REQ, CONTROL and,
   later, buffer acks and replies, which the relay forwards unchanged to
   the gateway; the gateway's answers and stream go back unchanged;
3. without takeover it stops once the destination holds everything the
   gateway logged and the TAP node reports nothing left for the ingest;
   with takeover the gateway's stream takes the vbucket over from the TAP
   node (TAP takeover; VBUCKET_SET(pending/active) become SET_VBUCKET_STATE,
   each TAP message acked only after the destination replied), and the move
   ends with STREAM_END(OK) and a check that the destination's vbucket is
   active.

Any failure raises ``UprFrontError`` naming the vbucket and what went wrong.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from pathlib import Path

import trio

from adapters import upr
from adapters.errors import GatewayError
from adapters.mcbp import Frame, Status
from adapters.mcbp.frames import HEADER
from gateway.fronts.moves import DestinationRefused, prepare_move_destination
from gateway.fronts.upr.config import UprFrontConfig, UprFrontError
from gateway.fronts.upr.server import UprFront
from gateway.io.connection import PacketConnection
from gateway.metrics.figures import GatewayStats
from gateway.runtime.logs import describe

log = logging.getLogger(__name__)

POLL = 0.05


def raw(frame: Frame) -> bytes:
    """The packet exactly as it came."""
    header = HEADER.pack(
        frame.magic,
        frame.opcode,
        frame.key_length,
        frame.extras_length,
        frame.datatype,
        frame.vbucket_or_status,
        len(frame.body),
        frame.opaque,
        frame.cas,
    )
    return header + frame.body


class _Relay:
    """Forwards everything between the gateway and the destination, but its own answers."""

    def __init__(
        self, gateway: PacketConnection, destination: PacketConnection, dialect: upr.Dialect
    ) -> None:
        self.gateway = gateway
        self.destination = destination
        self.dialect = dialect
        self.waiting: dict[int, trio.MemorySendChannel[upr.UprResponse]] = {}
        self.ended: dict[int, upr.StreamEndReason | int] = {}
        self.states: dict[int, list[upr.VBucketState]] = {}
        self.opaques = itertools.count(0xA000)

    async def pump(self, src: PacketConnection, dst: PacketConnection) -> None:
        while True:
            frame = await src.next_frame()
            event = upr.decode_frame(frame, self.dialect)
            waiter = self.waiting.pop(event.opaque, None) if event.IS_RESPONSE else None
            if waiter is not None:
                await waiter.send(event)  # type: ignore[arg-type]
                continue
            if isinstance(event, upr.StreamEnd):
                self.ended[event.vbucket] = event.reason
            elif isinstance(event, upr.SetVbucketState):
                self.states.setdefault(event.vbucket, []).append(event.state)
            await dst.send(raw(frame))

    async def request(self, peer: PacketConnection, event: upr.UprRequest) -> upr.UprResponse:
        send, receive = trio.open_memory_channel[upr.UprResponse](1)
        self.waiting[event.opaque] = send
        await peer.send(upr.encode(event, self.dialect))
        return await receive.receive()


async def _vbucket_state(client: PacketConnection, vb: int) -> str:
    return (await client.stats("vbucket")).get(f"vb_{vb}", "missing")


async def _high_seqno(client: PacketConnection, vb: int) -> int:
    return int((await client.stats(f"vbucket-seqno {vb}")).get(f"vb_{vb}:high_seqno", "0"))


async def move_tap_to_upr(
    from_tap: tuple[str, int],
    to_upr: tuple[str, int],
    vbuckets: list[int],
    *,
    takeover: bool,
    state_dir: Path,
    name: str = "replication:gateway",
    tap_name: str = "upr-move",
    upstream_user: str | None = None,
    upstream_password: str | None = None,
    timeout: float = 600.0,
    stats: GatewayStats | None = None,
    source_ssl: ssl.SSLContext | None = None,
    destination_ssl: ssl.SSLContext | None = None,
) -> None:
    """Move ``vbuckets`` from the TAP node ``from_tap`` into the UPR node ``to_upr``, each
    reached over TLS when given its context (the loopback to the move's own front stays
    plain)."""
    if not vbuckets:
        raise UprFrontError("no vbuckets to move")
    try:
        async with await PacketConnection.connect(
            *to_upr, name=f"the destination {to_upr[0]}:{to_upr[1]}", ssl_context=destination_ssl
        ) as client:
            await prepare_move_destination(client, vbuckets)
    except DestinationRefused as exc:
        raise UprFrontError(str(exc)) from None
    except OSError as exc:
        raise UprFrontError(
            f"cannot reach the destination {to_upr[0]}:{to_upr[1]}: {describe(exc, to_upr[0])}"
        ) from None
    config = UprFrontConfig(
        ("127.0.0.1", 0),
        from_tap,
        state_dir,
        upstream_user=upstream_user,
        upstream_password=upstream_password,
        upstream_ssl=source_ssl,
        tap_name=tap_name,
        vbuckets=tuple(vbuckets),
        compact_interval=0,
    )
    front = UprFront(config, stats)
    try:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(front.run)
                await _orchestrate(
                    front, port, to_upr, destination_ssl, vbuckets, takeover, name, tap_name
                )
                nursery.cancel_scope.cancel()
    except trio.TooSlowError:
        raise UprFrontError(f"move of vbuckets {vbuckets} did not finish in {timeout:g}s") from None
    except (OSError, trio.BrokenResourceError) as exc:
        raise UprFrontError(f"move of vbuckets {vbuckets} failed: {exc}") from exc
    except BaseExceptionGroup as group:
        failure = group.subgroup(lambda e: isinstance(e, GatewayError | OSError))
        if failure is None:
            raise
        first = failure.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        if isinstance(first, UprFrontError):
            raise first from None
        raise UprFrontError(f"move of vbuckets {vbuckets} failed: {first}") from first


async def _orchestrate(
    front: UprFront,
    port: int,
    to_upr: tuple[str, int],
    destination_ssl: ssl.SSLContext | None,
    vbuckets: list[int],
    takeover: bool,
    name: str,
    tap_name: str,
) -> None:
    dialect = front.dialect
    gateway = await PacketConnection.connect("127.0.0.1", port, name="the gateway")
    destination = await PacketConnection.connect(
        *to_upr, name=f"the destination {to_upr[0]}:{to_upr[1]}", ssl_context=destination_ssl
    )
    relay = _Relay(gateway, destination, dialect)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.pump, gateway, destination)
        nursery.start_soon(relay.pump, destination, gateway)
        for peer, open_flags in (
            (gateway, upr.OpenFlags.PRODUCER),
            (destination, upr.OpenFlags(0)),
        ):
            opened = await relay.request(
                peer, upr.Open(name.encode(), open_flags, opaque=next(relay.opaques))
            )
            if opened.status != Status.SUCCESS:
                raise UprFrontError(f"{peer.name} refused OPEN: status 0x{opened.status:02x}")
        await _wait_logged(front, vbuckets)
        flags = upr.StreamFlags.TAKEOVER if takeover else upr.StreamFlags(0)
        for vb in vbuckets:
            added = await relay.request(
                destination, upr.AddStream(flags, opaque=next(relay.opaques), vbucket=vb)
            )
            if added.status != Status.SUCCESS:
                text = getattr(added, "value", b"").decode("utf-8", "replace")
                raise UprFrontError(
                    f"vbucket {vb}: destination refused ADD_STREAM: 0x{added.status:02x} {text}"
                )
        async with await PacketConnection.connect(
            *to_upr, name=f"the destination {to_upr[0]}:{to_upr[1]}", ssl_context=destination_ssl
        ) as check:
            if takeover:
                await _finish_takeover(relay, check, vbuckets)
            else:
                await _finish_replication(front, relay, check, vbuckets, tap_name)
        nursery.cancel_scope.cancel()
    for peer in (gateway, destination):
        await peer.aclose()


async def _wait_logged(front: UprFront, vbuckets: list[int]) -> None:
    """Until the ingest has opened every vbucket's log (streams need one)."""
    while not all(vb in front.logs.logs for vb in vbuckets):
        await trio.sleep(POLL)


async def _finish_takeover(relay: _Relay, check: PacketConnection, vbuckets: list[int]) -> None:
    for vb in vbuckets:
        while vb not in relay.ended:
            await trio.sleep(POLL)
        reason = relay.ended[vb]
        if reason != upr.StreamEndReason.OK:
            raise UprFrontError(f"vbucket {vb}: the takeover stream ended with reason {reason}")
        state = await _vbucket_state(check, vb)
        if state != "active":
            raise UprFrontError(f"vbucket {vb}: destination is {state} after the takeover")
        log.info("vbucket %d moved; destination active", vb)


async def _finish_replication(
    front: UprFront, relay: _Relay, check: PacketConnection, vbuckets: list[int], tap_name: str
) -> None:
    host, port = front.config.tap_upstream
    async with await PacketConnection.connect(
        host, port, name=f"the source {host}:{port}", ssl_context=front.config.upstream_ssl
    ) as source:
        if front.config.upstream_user is not None:
            await source.sasl_plain(
                front.config.upstream_user, front.config.upstream_password or ""
            )
        for vb in vbuckets:
            while True:
                if vb in relay.ended:
                    raise UprFrontError(f"vbucket {vb}: stream ended early ({relay.ended[vb]})")
                left = await source.stats(f"vbucket-takeover {vb} {tap_name}")
                vblog = front.logs.logs[vb]
                if (
                    left.get("estimate") == "0"
                    and vblog.high_seqno == vblog.translator.high_seqno
                    and await _high_seqno(check, vb) >= vblog.high_seqno
                ):
                    break
                await trio.sleep(POLL)
