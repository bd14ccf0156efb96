"""What both vbucket moves ask of their destination before they stream into it."""

from __future__ import annotations

import struct

from adapters.errors import GatewayError
from adapters.mcbp import Opcode
from adapters.mcbp.constants import VBucketState
from gateway.io.connection import PacketConnection


class DestinationRefused(GatewayError):
    """A vbucket move's destination cannot take the vbucket."""


async def prepare_move_destination(client: PacketConnection, vbuckets: list[int]) -> None:
    """Make each vbucket a replica on a move's destination, as the orchestrator does before
    it streams into it; an ACTIVE one is refused, never demoted (it holds live data)."""
    states = await client.stats("vbucket")
    for vb in vbuckets:
        state = states.get(f"vb_{vb}")
        if state is None:
            raise DestinationRefused(f"vbucket {vb} does not exist on the destination")
        if state == "active":
            raise DestinationRefused(
                f"vbucket {vb} is active on the destination; refusing to overwrite it"
            )
        await client.request(
            Opcode.SET_VBUCKET, vbucket=vb, extras=struct.pack(">I", VBucketState.REPLICA)
        )
