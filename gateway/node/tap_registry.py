"""The node's TAP registry: live TAP connections, registered clients, statistics.

Theory of operation. Every TAP producer connection runs inside ``running``,
which keeps it under its name (an unnamed one gets ``anon_<n>``, as 2.x
named them) together with a ``trio.CancelScope``. A second connection under
a name already open cancels the older one, as 2.x dropped a TAP connection
whose name was reused; a connection unregisters only itself, so the older
one's late exit cannot remove the newer one. A registered client is the
exception: its CONNECT under a name that is streaming is refused and the
first keeps streaming (``serve_tap_stream`` asks ``holds``).

A client that connects with REGISTERED_CLIENT gets a ``Registration`` that
outlives its connections for as long as the node runs: per vbucket the last
position the client is known to hold (what it acked with support-ack, else
what was sent). Reconnecting under the same name resumes from there.
``deregister`` (memcached opcode 0x9e) forgets it and closes its connection.

``stats`` renders ``STAT tap`` with 2.x names: ``ep_tap_*`` totals and the
configured intervals, then per connection ``eq_tapq:<name>:<stat>``;
registered clients that are not connected still show, with
``connected false``, as 2.x kept them. ``takeover_stats`` answers
``STAT vbucket-takeover <vb> <name>`` (2.x's ``tap-vbtakeover``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from adapters.tap.stats import seconds, tap_group
from gateway.io.named import NamedConnections

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VbPosition:
    """Where a client stands in one vbucket."""

    seqno: int
    """Every latest version up to this by_seqno has reached the client."""
    checkpoint_id: int
    """The checkpoint it was in (0: still in backfill, no checkpoint yet)."""
    backfill_done: bool = True
    """False while a backfill is under way: resuming continues it."""


@dataclass
class Registration:
    name: str
    positions: dict[int, VbPosition] = field(default_factory=dict)
    connections: int = 0
    """How many connections have used this registration (reconnects + 1)."""


class TapConnection(Protocol):
    """What the registry needs from a live producer connection."""

    name: str

    @property
    def items_sent(self) -> int: ...

    @property
    def items_remaining(self) -> int: ...

    @property
    def deletes_sent(self) -> int: ...

    def connection_figures(self) -> dict[str, object]:
        """Per-connection figures by ``adapters.tap.stats`` name."""
        ...

    def takeover_stats(self, vbucket: int) -> dict[str, str] | None: ...


def tap_name(raw: bytes | str) -> str:
    """A client name as the registry keys it (bytes that are not UTF-8 stay distinct)."""
    if isinstance(raw, str):
        return raw
    return raw.decode("utf-8", "backslashreplace")


class TapHub:
    """Open TAP connections and registered clients; one per node, ``TapHub(node)``."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self._named: NamedConnections[TapConnection] = NamedConnections("TAP")
        self._registrations: dict[str, Registration] = {}
        self._anon = itertools.count(1)
        self.items_sent_closed = 0
        """Items sent by connections that have ended (ep_tap_total_fetched keeps them)."""

    # -- connections ---------------------------------------------------------

    def connection_name(self, raw: bytes) -> str:
        return tap_name(raw) if raw else f"anon_{next(self._anon)}"

    @contextmanager
    def running(self, connection: TapConnection) -> Iterator[trio.CancelScope]:
        """Register ``connection`` while the block runs; a later namesake cancels it."""
        try:
            with self._named.running(connection.name, connection) as scope:
                yield scope
        finally:
            self.items_sent_closed += connection.items_sent

    def holds(self, name: str) -> bool:
        """A connection streams under ``name`` and is not being closed."""
        return self._named.holds(name)

    def get(self, name: str) -> TapConnection | None:
        return self._named.get(name)

    def connections(self) -> list[TapConnection]:
        return self._named.values()

    # -- registered clients --------------------------------------------------

    def register(self, name: str) -> Registration:
        """The registration under ``name``, created on first use."""
        registration = self._registrations.get(name)
        if registration is None:
            registration = self._registrations[name] = Registration(name)
        registration.connections += 1
        return registration

    def registration(self, name: str) -> Registration | None:
        return self._registrations.get(name)

    def deregister(self, name: bytes | str) -> bool:
        """Forget a registered client and close its connection; whether it existed."""
        key = tap_name(name)
        registration = self._registrations.pop(key, None)
        if registration is None:
            return False
        self._named.close(key)
        return True

    # -- statistics ----------------------------------------------------------

    def stats(self) -> list[tuple[str, str]]:
        conns = sorted(self.connections(), key=lambda c: c.name)
        config = self.node.config
        totals: dict[str, object] = {
            "count": len(conns),
            "total_fetched": self.items_sent_closed + sum(c.items_sent for c in conns),
            "total_backlog_size": sum(c.items_remaining for c in conns),
            "deletes": sum(c.deletes_sent for c in conns),
            "ack_interval": config.tap_ack_interval,
            "ack_window_size": config.tap_max_unacked,
            "backoff_period": seconds(config.tap_backoff),
            "noop_interval": seconds(config.tap_noop_interval),
        }
        figures = {conn.name: conn.connection_figures() for conn in conns}
        for name in sorted(self._registrations):
            if name not in self._named:
                figures[name] = _offline_figures(self._registrations[name])
        return tap_group(totals, figures)

    def takeover_stats(self, vbucket: int, name: str) -> dict[str, str] | None:
        conn = self.get(tap_name(name))
        if conn is None:
            return None
        return conn.takeover_stats(vbucket)


def _offline_figures(registration: Registration) -> dict[str, object]:
    """A registered client with no connection open."""
    return {
        "type": "producer",
        "connected": False,
        "registered": True,
        "reconnects": max(0, registration.connections - 1),
        "vb_filters": len(registration.positions),
    }
