"""The UPR front: UPR (3.0 DCP) consumers served from a TAP node through a durable log.

Shape: ingest (one TAP connection upstream) -> durable log per vbucket ->
fan-out to any number of UPR consumers. See ``server`` for the whole, and
``ingest``, ``vblog``, ``compaction``, ``producer``, ``streams`` for the
parts. Entry points: ``serve_upr_front`` and ``move_tap_to_upr``.
"""

from __future__ import annotations

import trio

from gateway.fronts.upr.config import UprFrontConfig, UprFrontError
from gateway.fronts.upr.move import move_tap_to_upr
from gateway.fronts.upr.server import UprFront
from gateway.metrics.figures import GatewayStats

__all__ = ["UprFront", "UprFrontConfig", "UprFrontError", "move_tap_to_upr", "serve_upr_front"]


async def serve_upr_front(
    config: UprFrontConfig,
    *,
    stats: GatewayStats | None = None,
    close_logs: bool = True,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the UPR front until cancelled; ``task_status`` gets the bound UPR port.

    ``close_logs=False`` leaves the logs as a crash would (no clean mark):
    for tests that simulate a kill.
    """
    front = UprFront(config, stats)
    await front.run(close_logs=close_logs, task_status=task_status)
