"""A TAP session's settings, and what an acknowledgement settles.

``Settlement``: each batch's upstream flow-control credit, the replies the
upstream waits for and the positions reached, attached to the last TAP
message of the batch and settled once that message is acked (see
``gateway.fronts.tap.session``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from adapters import upr
from gateway.fronts.tap.registry import VbResume
from gateway.fronts.tap.vbstream import VbStream


@dataclass
class SessionConfig:
    upstream: tuple[str, int]
    dialect: upr.Dialect = upr.DCP
    user: str | None = None
    password: str | None = None
    buffer_size: int = 8 * 1024 * 1024
    ack_interval: int = 1000
    max_unacked: int = 10_000
    backoff: float = 5.0
    noop_interval: float = 20.0
    reconnect_initial: float = 0.1
    reconnect_max: float = 5.0
    reconnect_attempts: int | None = None
    """Consecutive failed reconnects before giving up (None: never give up)."""
    capture_dir: Path | None = None
    """Record what each connection receives and sends there (see ``gateway.tools.capture``)."""
    ssl_context: ssl.SSLContext | None = None
    """TLS to the upstream (None: plain TCP)."""


@dataclass
class Settlement:
    """What becomes final once a TAP message is acknowledged (see the module docstring)."""

    generation: int = 0
    credit: int = 0
    replies: list[bytes] = field(default_factory=list)
    touched: dict[int, VbStream] = field(default_factory=dict)
    """Streams that sent messages in it; their positions are taken when it closes."""
    positions: dict[int, VbResume] = field(default_factory=dict)
    """A registered client's positions reached (the registry keeps them)."""
    seqnos: dict[int, int] = field(default_factory=dict)
    """Another client's: the seqno reached is all its acks settle."""
    arrival: float = 0.0
    """Wall-clock arrival of the oldest upstream item in it (0: none)."""

    def merge(self, other: Settlement) -> None:
        if other.generation == self.generation:
            self.credit += other.credit
            self.replies.extend(other.replies)
        self.positions.update(other.positions)
        self.seqnos.update(other.seqnos)
        if other.arrival and not self.arrival:
            self.arrival = other.arrival

    def close(self, generation: int, registered: bool) -> None:
        """Take the positions of the streams touched (``registered``: whole positions,
        else the seqnos: a ``VbResume`` per vbucket and batch cost more than the rest
        of a live batch's bookkeeping)."""
        self.generation = generation
        if registered:
            for vbucket, stream in self.touched.items():
                self.positions[vbucket] = stream.position()
        else:
            seqnos = self.seqnos
            for vbucket, stream in self.touched.items():
                seqnos[vbucket] = stream.translator.last_seqno
        self.touched.clear()

    @property
    def empty(self) -> bool:
        return not (self.credit or self.replies or self.positions or self.seqnos)
