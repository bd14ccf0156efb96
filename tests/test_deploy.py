"""The example deployment files: the config parses for serve, the systemd unit verifies."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import settings
from gateway.cli.main import _commands, build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_the_example_config_is_valid_for_serve() -> None:
    parser = build_parser()
    argv = ["serve", "--config", str(DEPLOY / "tap-upr-gateway.toml")]
    settings.load(argv, _commands(parser), {})
    args = parser.parse_args(argv)
    assert args.tap_upstream == ("127.0.0.1", 11211)
    assert args.state_dir == Path("/var/lib/tap-upr-gateway")
    assert args.log_format == "json"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd not on this machine")
def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (DEPLOY / "tap-upr-gateway.service").read_text()
    # verify checks that ExecStart's binary exists: point it at this install
    binary = shutil.which("tap-upr-gateway") or f"{sys.executable} -m gateway"
    unit = unit.replace("/usr/local/bin/tap-upr-gateway", binary)
    path = tmp_path / "tap-upr-gateway.service"
    path.write_text(unit)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "tap-upr-gateway.service" not in done.stderr, done.stderr
