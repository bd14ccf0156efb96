"""The node's registry of open UPR connections, and their statistics.

Theory of operation. Every UPR connection, producer or consumer, registers
under its name for as long as it runs, inside a ``trio.CancelScope`` the hub
keeps. Opening a connection under a name already taken cancels the older
one's scope, as 3.0 closes a connection whose name is reused: that handler
returns and its socket closes, while the newer one carries on under the
name. A connection unregisters only itself, so a late exit of the old one
cannot remove the new one.

``stats`` renders ``STAT dcp`` (and ``STAT upr``) the way 3.0 names it:
``ep_dcp_*`` totals, then per connection ``eq_dcpq:<name>:<stat>``, with
the pre-release ``ep_upr_*``/``eq_uprq:`` spellings as aliases.
``takeover_stats`` answers ``STAT dcp-vbtakeover <vb> <name>``: how much a
stream has still to send, which an orchestrator polls before it takes over.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any, Protocol

import trio

from gateway.io.named import NamedConnections
from gateway.io.stat_replies import dcp_group

log = logging.getLogger(__name__)


class HubConnection(Protocol):
    """What the hub needs from a producer or consumer connection."""

    name: str
    kind: str
    """``"producer"`` or ``"consumer"``."""

    @property
    def items_sent(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

    @property
    def items_remaining(self) -> int: ...

    def connection_stats(self) -> list[tuple[str, str]]:
        """Per-connection stats, names without the ``eq_dcpq:<name>:`` prefix."""
        ...

    def takeover_stats(self, vbucket: int) -> dict[str, str] | None: ...


class UprHub:
    """Open UPR connections by name; constructed once per node as ``UprHub(node)``."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self._named: NamedConnections[HubConnection] = NamedConnections("UPR")
        self.initial_backfill: set[int] = set()
        """Vbuckets receiving their initial backfill, answered TMPFAIL by
        ``UprProducer::streamRequest`` (ep-engine 3.0: their open checkpoint id
        is 0): over UPR from a DISK marker into an empty vbucket until its end
        seqno is applied or the next marker (src/upr-stream.cc
        ``PassiveStream::processMarker``, ``handleSnapshotEnd``), over TAP
        from OPAQUE(INITIAL_VBUCKET_STREAM) to the first CHECKPOINT_START
        (``tap_receiver``); either way until the vbucket becomes ACTIVE
        (src/vbucket.cc ``VBucket::setState``)."""

    def running(self, connection: HubConnection) -> AbstractContextManager[trio.CancelScope]:
        """Register ``connection`` while the block runs; a later namesake cancels it."""
        return self._named.running(connection.name, connection)

    def get(self, name: str) -> HubConnection | None:
        return self._named.get(name)

    def connections(self) -> list[HubConnection]:
        return self._named.values()

    # -- statistics ----------------------------------------------------------

    def stats(self) -> list[tuple[str, str]]:
        conns = self.connections()
        producers = [c for c in conns if c.kind == "producer"]
        totals = [
            ("count", len(conns)),
            ("producer_count", len(producers)),
            ("consumer_count", len(conns) - len(producers)),
            ("total_bytes", sum(c.total_bytes for c in conns)),
            ("items_sent", sum(c.items_sent for c in producers)),
            ("items_remaining", sum(c.items_remaining for c in producers)),
        ]
        per_connection: list[tuple[str, str]] = []
        for conn in sorted(conns, key=lambda c: c.name):
            per_connection.extend(
                (f"{conn.name}:{stat}", value) for stat, value in conn.connection_stats()
            )
        return dcp_group(totals, per_connection)

    def takeover_stats(self, vbucket: int, name: str) -> dict[str, str] | None:
        conn = self.get(name)
        if conn is None:
            return None
        return conn.takeover_stats(vbucket)
