"""Settings of the UPR front (``UprFrontConfig``) and its error type."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from adapters.errors import GatewayError
from adapters.mcbp.frames import DEFAULT_MAX_FRAME_SIZE
from gateway.io.auth import Users
from gateway.io.limits import ConnectionLimits


class UprFrontError(GatewayError):
    """The UPR front could not do what it was asked (a move failed, bad settings, ...)."""


@dataclass
class UprFrontConfig:
    listen: tuple[str, int]
    """Where UPR consumers connect (port 0: any free port)."""
    tap_upstream: tuple[str, int]
    """The TAP (2.x-style) node the gateway reads from."""
    state_dir: Path
    """The durable log, one directory per vbucket."""
    dialect: str = "dcp"
    upstream_user: str | None = None
    upstream_password: str | None = None
    users: Users | dict[str, str] | None = None
    """SASL PLAIN credentials consumers must present (None: no authentication)."""
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    """Frame sizes, timeouts and connection count of the listener (``gateway.io.limits``)."""
    ssl_context: ssl.SSLContext | None = None
    """Serve TLS (None: plain TCP)."""
    upstream_ssl: ssl.SSLContext | None = None
    """TLS to the TAP upstream (None: plain TCP)."""
    fsync: str = "batch"
    """"always" (per TAP message), "batch" (per ingested batch, before its acks) or "never"."""
    tap_name: str = "upr-front"
    """The registered TAP client name; keep it stable across restarts."""
    vbuckets: tuple[int, ...] | None = None
    """Stream these vbuckets (None: every active one the upstream reports)."""
    expiry_tolerance: float = 1.0
    """Seconds a delete may come before its item's expiration and still be an expiration."""
    purge_interval: float = 3600.0
    """Compaction keeps tombstones at least this long (seconds)."""
    compact_interval: float = 300.0
    """Seconds between compaction rounds (0: never compact on a timer)."""
    segment_bytes: int = 64 * 1024 * 1024
    tail_bytes: int = 8 * 1024 * 1024
    """Per vbucket at most, the latest writes kept in memory for streams that keep up
    (the rest are read from the log on disk); beyond 256 KiB only while all tails
    together hold under 64 MiB more (``log_tail``)."""
    reconnect_min: float = 0.1
    reconnect_max: float = 5.0
    noop_interval: float = 180.0
    """Default NOOP interval of consumer connections (CONTROL may change it)."""
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    max_outbox_bytes: int = 4 * 1024 * 1024
    seed: int | None = None
    """Seed of vbucket uuids (tests); None: random."""
    capture_dir: Path | None = None
    """Record, as capture segments, what the ingest receives from the TAP upstream
    (side tap, received) and what each consumer connection is sent (side upr,
    sent). None: no captures."""
