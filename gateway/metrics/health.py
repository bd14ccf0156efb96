"""What ``/healthz``, ``/readyz`` and the status page say about the process.

``serve`` fills one ``Health``: the fronts it runs (and where they listen),
each upstream's state as the upstream watch last saw it, whether every
listener is bound and whether the UPR front's logs were proven at start-up.
The metrics server only reads it, on the trio thread.

Alive (``/healthz``) means the event loop answers. Ready (``/readyz``) means
every listener is bound, every upstream answered its latest check, and the
UPR front (when it runs) proved its logs and can write them; otherwise the JSON body lists, one
sentence each, what is not ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.metrics.figures import UprLogStats


@dataclass
class UpstreamHealth:
    """One upstream as the watch last saw it."""

    option: str
    """The option that named it (``--upr-upstream``), or ``embedded node``."""
    address: str
    reachable: bool | None = None
    """None until the first check ends."""
    detail: str = "not checked yet"
    since: float = field(default_factory=time.time)
    """Wall-clock time ``reachable`` last changed."""
    checked: float = 0.0
    """Wall-clock time of the last check (0: none yet)."""

    def record(self, reachable: bool, detail: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if reachable != self.reachable:
            self.since = now
        self.reachable, self.detail, self.checked = reachable, detail, now

    def problem(self) -> str | None:
        if self.reachable:
            return None
        if self.reachable is None:
            return f"{self.option} {self.address} not checked yet"
        return f"{self.option} {self.address} is unreachable: {self.detail}"

    def as_json(self) -> dict[str, Any]:
        return {
            "option": self.option,
            "address": self.address,
            "reachable": self.reachable,
            "detail": self.detail,
            "since": self.since,
            "checked": self.checked or None,
        }


@dataclass
class FrontInfo:
    """A front ``serve`` runs."""

    direction: str
    """``tap_front`` or ``upr_front`` (the metrics' ``direction`` label)."""
    title: str
    listen: str
    upstream: UpstreamHealth


@dataclass
class Health:
    started: float = field(default_factory=time.time)
    listeners_bound: bool = False
    logs_proven: bool | None = None
    """None: no UPR front; False: its logs are being proven; True: proven."""
    logs_set_aside: int = 0
    fronts: list[FrontInfo] = field(default_factory=list)
    upstreams: dict[str, UpstreamHealth] = field(default_factory=dict)
    """By option (``--upr-upstream``, ``--tap-upstream``, ``embedded node``)."""
    upr_log: UprLogStats | None = None
    """The UPR front's log (when it runs): a write the file system refuses is not ready."""

    def upstream(self, option: str, address: str) -> UpstreamHealth:
        found = self.upstreams.get(option)
        if found is None:
            found = self.upstreams[option] = UpstreamHealth(option, address)
        return found

    def problems(self) -> list[str]:
        """What is not ready, one sentence each (empty: ready)."""
        out: list[str] = []
        if not self.listeners_bound:
            out.append("listeners are still being bound")
        for upstream in self.upstreams.values():
            problem = upstream.problem()
            if problem is not None:
                out.append(problem)
        if self.logs_proven is False:
            out.append("the UPR front is still proving its logs")
        failing = self.upr_log.write_failing() if self.upr_log is not None else None
        if failing is not None:
            out.append(f"the UPR front cannot write its log: {failing}")
        return out

    def readiness(self) -> dict[str, Any]:
        problems = self.problems()
        return {
            "ready": not problems,
            "not_ready": problems,
            "listeners_bound": self.listeners_bound,
            "logs_proven": self.logs_proven,
            "logs_set_aside": self.logs_set_aside,
            "upstreams": [u.as_json() for u in self.upstreams.values()],
        }

    def snapshot(self, now: float) -> dict[str, Any]:
        """Readiness, the fronts and uptime, copied on the thread that updates them."""
        return {
            "started": self.started,
            "uptime_seconds": round(max(0.0, now - self.started), 1),
            **self.readiness(),
            "fronts": [
                {
                    "direction": front.direction,
                    "title": front.title,
                    "listen": front.listen,
                    "upstream": front.upstream.as_json(),
                }
                for front in self.fronts
            ],
        }
