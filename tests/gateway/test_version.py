"""The gateway's version: ``--version``, the start-up log line, ``tapupr_build_info``,
and the VERSION replies of both fronts (memcached answers VERSION with the
server's own version, so the fronts give the gateway's)."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import trio

from adapters.mcbp import Opcode
from gateway.cli.serve import ServeOptions, run_serve
from gateway.fronts.upr import UprFrontConfig, serve_upr_front
from gateway.io.connection import PacketConnection
from gateway.metrics.families import gateway_families
from gateway.metrics.figures import GatewayStats
from gateway.metrics.render import render
from gateway.metrics.view import capture
from gateway.runtime import version as version_module
from gateway.runtime.version import describe, version
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import start_node
from tests.support.tapfront import filled_store

ROOT = Path(__file__).resolve().parents[2]
PROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_is_the_projects() -> None:
    assert version() == PROJECT_VERSION
    assert describe() == f"tap-upr-gateway {PROJECT_VERSION} (Python {platform.python_version()})"


def test_version_falls_back_without_tree_or_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version_module, "_source_tree_version", lambda: None)
    monkeypatch.setattr(version_module.metadata, "version", missing)
    version_module.version.cache_clear()
    try:
        assert version() == version_module.FALLBACK
    finally:
        version_module.version.cache_clear()


def test_version_option_prints_one_line_and_exits_0() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--version"], capture_output=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() == describe()
    assert done.stderr == b""


def test_build_info_gauge() -> None:
    text = render(gateway_families(capture(GatewayStats(), 0.0)), openmetrics=False).decode()
    python = platform.python_version()
    expected = f'tapupr_build_info{{version="{PROJECT_VERSION}",python="{python}"}} 1.0'
    assert expected in text.splitlines()


async def test_start_up_log_line_names_the_version(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    _, node_port = await start_node(nursery, filled_store())
    options = ServeOptions(
        tap_listen=("127.0.0.1", 0), upr_upstream=("127.0.0.1", node_port), metrics_listen=None
    )
    with caplog.at_level(logging.INFO, logger="gateway.cli.serve"):
        await nursery.start(run_serve, options)
    assert f"{describe()} serving" in caplog.messages


async def test_tap_front_version_reply(nursery: trio.Nursery) -> None:
    rig = await tap_front_over_node(nursery, filled_store())
    async with await PacketConnection.connect("127.0.0.1", rig.port) as client:
        answer = await client.request(Opcode.VERSION)
    assert answer.value.decode() == f"tap-upr-gateway {PROJECT_VERSION} (TAP front)"


async def test_upr_front_version_reply(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, node_port = await start_node(nursery, filled_store())
    config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", node_port), tmp_path)
    port = await nursery.start(serve_upr_front, config)
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        answer = await client.request(Opcode.VERSION)
    assert answer.value.decode() == f"tap-upr-gateway {PROJECT_VERSION} (UPR front)"
