"""What a listener allows a connection before it has proved itself.

A connection goes through up to three stages:

- ``AUTH``: SASL is required and has not succeeded. Frames are small
  (``pre_auth_frame_size``: SASL, VERSION, NOOP) and the connection must
  authenticate within ``handshake_timeout`` of being accepted.
- ``COMMAND``: authenticated (or no SASL required), not streaming yet. Frames
  up to ``command_frame_size`` (STAT, a TAP CONNECT or UPR OPEN with its
  vbucket lists); on the fronts such a connection is closed once idle for
  ``handshake_timeout`` (``command_idle_timeout``).
- ``STREAM``: after TAP CONNECT / UPR OPEN (or a plain memcached command
  connection on the node): the full ``max_frame_size``.

So a peer that never authenticates can make a listener buffer only a few
KiB, and not for long. In every stage a frame that has started must arrive
whole within ``frame_timeout`` (plus one second per ``min_body_rate`` bytes
of a large body), so a header trickled one byte a second is cut off.

``ListenerCounters`` counts what the listeners refused, for the metrics.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass, field, replace

from adapters.mcbp import DEFAULT_MAX_FRAME_SIZE

DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_HANDSHAKE_TIMEOUT = 30.0
DEFAULT_FRAME_TIMEOUT = 10.0
PRE_AUTH_FRAME_SIZE = 4 * 1024
COMMAND_FRAME_SIZE = 16 * 1024
"""Room for a TAP CONNECT naming 1,024 vbuckets with their checkpoint ids (about 12 KiB)."""
MIN_BODY_RATE = 64 * 1024
"""Bytes a second a large frame's body may take at the slowest (on top of ``frame_timeout``)."""


class Stage(enum.Enum):
    AUTH = "auth"
    COMMAND = "command"
    STREAM = "stream"


@dataclass(frozen=True)
class ConnectionLimits:
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    pre_auth_frame_size: int = PRE_AUTH_FRAME_SIZE
    command_frame_size: int = COMMAND_FRAME_SIZE
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    """Seconds from accept to a successful SASL authentication (when one is required)."""
    command_idle_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT
    """Seconds a connection may stay idle before its TAP CONNECT / UPR OPEN (None: no limit)."""
    frame_timeout: float = DEFAULT_FRAME_TIMEOUT
    min_body_rate: int = MIN_BODY_RATE
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_auth_failures: int = 5
    """Failed SASL attempts after which a connection is closed."""
    auth_failure_delay: float = 0.25
    """Seconds before answering the first failed attempt; doubled for each next one."""

    def frame_size(self, stage: Stage) -> int:
        if stage is Stage.AUTH:
            return min(self.pre_auth_frame_size, self.max_frame_size)
        if stage is Stage.COMMAND:
            return min(self.command_frame_size, self.max_frame_size)
        return self.max_frame_size

    def frame_allowance(self, body_length: int) -> float:
        """Seconds a frame of ``body_length`` may take from its first byte to its last."""
        return self.frame_timeout + body_length / self.min_body_rate

    def with_frame_size(self, max_frame_size: int) -> ConnectionLimits:
        return replace(self, max_frame_size=max_frame_size)


NO_LIMITS = ConnectionLimits(
    handshake_timeout=math.inf,
    command_idle_timeout=None,
    frame_timeout=math.inf,
    max_connections=2**31,
)
"""For connections the gateway opens itself (its upstreams, captures)."""


@dataclass
class ListenerCounters:
    """What the listeners refused or cut off, by listener name (``tap-front``, ...)."""

    open_connections: Counter[str] = field(default_factory=Counter)
    """Connections open now."""
    refusals_total: Counter[str] = field(default_factory=Counter)
    """Connections refused because ``max_connections`` were open."""
    timeouts_total: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Connections closed by a timeout, by (listener, what: handshake, idle, frame)."""
    frames_refused_total: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Frames over the stage's size limit, by (listener, stage)."""
    auth_failures_total: Counter[str] = field(default_factory=Counter)
    """Failed SASL attempts."""
    admin_refusals_total: Counter[str] = field(default_factory=Counter)
    """Destructive commands refused to a user not marked admin."""

    def copy(self) -> ListenerCounters:
        """A copy a scrape may read from another thread."""
        return ListenerCounters(
            Counter(self.open_connections),
            Counter(self.refusals_total),
            Counter(self.timeouts_total),
            Counter(self.frames_refused_total),
            Counter(self.auth_failures_total),
            Counter(self.admin_refusals_total),
        )
