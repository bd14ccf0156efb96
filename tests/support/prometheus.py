"""A real Prometheus server for tests: the ``prometheus`` binary on a loopback port.

``run_prometheus(targets)`` starts it with a temporary config (a short scrape
interval) and storage directory, waits for ``/-/ready`` and stops it at the
end. ``Prometheus.query`` asks the HTTP API; ``wait_for`` polls a PromQL
expression until a predicate holds on its result. Any test can scrape
something of its own, e.g. a gateway's ``/metrics``:

    async with run_prometheus([f"127.0.0.1:{port}"]) as prom:
        await prom.wait_for("tapupr_active_connections", lambda r: len(r) > 0)

``PROMETHEUS`` and ``PROMTOOL`` are the binaries' paths, or ``None`` when the
Debian ``prometheus`` package is not installed (``scripts/test`` installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = "the Debian prometheus package is not installed (scripts/test installs it)"

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0

Result = list[dict[str, Any]]


class PrometheusError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape_config(targets: list[str], *, scrape_interval: str, metrics_path: str) -> str:
    """A prometheus.yml scraping ``targets`` (JSON is valid YAML)."""
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [
            {
                "job_name": "tapupr",
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "metrics_path": metrics_path,
                "static_configs": [{"targets": targets}],
            }
        ],
    }
    return json.dumps(config, indent=2)


@dataclass
class Prometheus:
    url: str
    process: trio.Process
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _get(self, path: str, params: dict[str, str] | None = None) -> tuple[int, bytes]:
        url = self.url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    async def get(self, path: str, params: dict[str, str] | None = None) -> tuple[int, bytes]:
        return await trio.to_thread.run_sync(self._get, path, params)

    async def query(self, expr: str) -> Result:
        """An instant query's result; a PromQL error raises with Prometheus' message."""
        status, body = await self.get("/api/v1/query", {"query": expr})
        reply = json.loads(body)
        if status != 200 or reply.get("status") != "success":
            raise PrometheusError(f"{expr!r}: {status} {reply.get('error', body[:200])}")
        data = reply["data"]
        if data["resultType"] not in ("vector", "matrix"):
            return [{"metric": {}, "value": data["result"]}]
        result: Result = data["result"]
        return result

    async def wait_for(
        self,
        expr: str,
        predicate: Callable[[Result], bool],
        *,
        timeout: float = 20.0,
        interval: float = 0.2,
    ) -> Result:
        """Poll ``expr`` until ``predicate(result)``; the last result in the error otherwise."""
        result: Result = []
        with trio.move_on_after(timeout):
            while True:
                result = await self.query(expr)
                if predicate(result):
                    return result
                await trio.sleep(interval)
        raise AssertionError(f"{expr!r} never satisfied the condition; last result {result}")


def values(result: Result) -> list[float]:
    """The sample values of an instant vector."""
    return [float(sample["value"][1]) for sample in result]


async def _wait_ready(prom: Prometheus) -> None:
    with trio.move_on_after(READY_TIMEOUT):
        while True:
            if prom.process.poll() is not None:
                raise PrometheusError(f"prometheus exited early:\n{prom.log_tail()}")
            try:
                status, _ = await prom.get("/-/ready")
            except OSError:
                status = 0
            if status == 200:
                return
            await trio.sleep(0.1)
    raise PrometheusError(f"prometheus not ready in {READY_TIMEOUT:g} s:\n{prom.log_tail()}")


@asynccontextmanager
async def run_prometheus(
    targets: list[str], *, scrape_interval: str = "500ms", metrics_path: str = "/metrics"
) -> AsyncIterator[Prometheus]:
    """A Prometheus scraping ``targets`` on 127.0.0.1, stopped and removed on exit."""
    if PROMETHEUS is None:
        raise PrometheusError(MISSING)
    with tempfile.TemporaryDirectory(prefix="tapupr-prometheus-") as tmp:
        root = Path(tmp)
        config = root / "prometheus.yml"
        config.write_text(
            scrape_config(targets, scrape_interval=scrape_interval, metrics_path=metrics_path)
        )
        port = free_port()
        log_path = root / "prometheus.log"
        with log_path.open("wb") as log:
            process = await trio.lowlevel.open_process(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        prom = Prometheus(f"http://127.0.0.1:{port}", process, log_path)
        try:
            await _wait_ready(prom)
            yield prom
        finally:
            with trio.CancelScope(shield=True):
                process.terminate()
                with trio.move_on_after(STOP_TIMEOUT) as scope:
                    await process.wait()
                if scope.cancelled_caught:
                    process.kill()
                    await process.wait()


# -- the Grafana dashboard's queries ----------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "dashboards" / "tap-upr-gateway.json"
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}


@dataclass(frozen=True)
class DashboardQuery:
    where: str
    """Panel title and refId, or ``variable <name>``."""
    expr: str
    label: str | None = None
    """For a ``label_values(selector, label)`` variable: the label it lists."""


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def dashboard_queries(path: Path = DASHBOARD) -> list[DashboardQuery]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    board = json.loads(path.read_text())
    out: list[DashboardQuery] = []
    for panel in _panels(board["panels"]):
        for target in panel.get("targets", []):
            out.append(DashboardQuery(f"{panel['title']} / {target['refId']}", target["expr"]))
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        inner = text.strip()
        if inner.startswith("label_values(") and inner.endswith(")"):
            selector, _, label = inner[len("label_values(") : -1].rpartition(",")
            out.append(DashboardQuery(f"variable {variable['name']}", selector, label.strip()))
        else:
            out.append(DashboardQuery(f"variable {variable['name']}", text))
    return out


def dashboard_variables(path: Path = DASHBOARD) -> set[str]:
    return {v["name"] for v in json.loads(path.read_text())["templating"]["list"]}


def grafana_substitute(expr: str, *, rate_interval: str = "5s", match: str = ".+") -> str:
    """``expr`` as Grafana would send it with every variable at "All" (regex ``match``)."""
    for builtin in sorted(GRAFANA_BUILTINS, key=len, reverse=True):
        expr = expr.replace("${" + builtin + "}", rate_interval)
        expr = expr.replace("$" + builtin, rate_interval)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", match, expr)
