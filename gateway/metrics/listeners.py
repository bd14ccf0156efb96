"""Metric families of the listeners' own guards (``gateway.io.limits.ListenerCounters``):
open connections, connections refused past ``--max-connections``, timeouts,
frames over a stage's limit, failed SASL attempts and refused admin commands,
each labelled by listener (``tap-front``, ``upr-front``)."""

from __future__ import annotations

from collections import Counter

from gateway.io.limits import ListenerCounters
from gateway.metrics.families import Family, Labels, counter, gauge

LISTENERS = ("tap-front", "upr-front")


def _by_listener(family: Family, values: Counter[str], suffix: str = "") -> Family:
    for listener in sorted({*LISTENERS, *values}):
        family.add(Labels.of(listener=listener), values.get(listener, 0), suffix)
    return family


def listener_families(counters: ListenerCounters) -> list[Family]:
    timeouts = counter(
        "listener_timeouts_total",
        "Connections closed for taking too long: to authenticate (handshake), to send a "
        "TAP CONNECT or UPR OPEN (idle), to finish a frame (frame); failed TLS handshakes (tls).",
    )
    for (listener, kind), count in sorted(counters.timeouts_total.items()):
        timeouts.add(Labels.of(listener=listener, kind=kind), count, "_total")
    frames = counter(
        "listener_frames_refused_total",
        "Frames over the size allowed before authentication (auth) or before CONNECT/OPEN "
        "(command); the connection is closed.",
    )
    for (listener, stage), count in sorted(counters.frames_refused_total.items()):
        frames.add(Labels.of(listener=listener, stage=stage), count, "_total")
    return [
        _by_listener(
            gauge("listener_open_connections", "Connections open now."), counters.open_connections
        ),
        _by_listener(
            counter(
                "listener_refusals_total",
                "Connections refused because --max-connections were open.",
            ),
            counters.refusals_total,
            "_total",
        ),
        timeouts,
        frames,
        _by_listener(
            counter("sasl_failures_total", "Failed SASL authentication attempts."),
            counters.auth_failures_total,
            "_total",
        ),
        _by_listener(
            counter(
                "admin_refusals_total",
                "Destructive commands refused to users not marked admin in the users file.",
            ),
            counters.admin_refusals_total,
            "_total",
        ),
    ]
