"""A state directory serves one process: a second `serve` (or `node --data-dir`, or
`move --state-dir`) on it is refused with one line, before it touches anything.

Without the lock, a second `serve` took the first one's open logs for a crash's
(new failover entries on every vbucket) and then wrote into them beside it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from gateway.cli.serve import ServeOptions, run_serve
from gateway.cli.startup import LOCK_NAME, lock_directory, startup_error_in
from gateway.runtime.version import describe

GATEWAY = [sys.executable, "-m", "gateway"]
FREE = ["--tap-listen", "127.0.0.1:0", "--upr-listen", "127.0.0.1:0", "--no-metrics"]


def run(*args: str) -> tuple[int, str]:
    done = subprocess.run([*GATEWAY, *args], capture_output=True, timeout=60, text=True)
    return done.returncode, done.stderr


def only_line(stderr: str) -> str:
    """The error: the one line that is not a log line (serve logs its start first)."""
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not line[:4].isdigit()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["serve", *FREE, "--tap-upstream", "127.0.0.1:9"], "--state-dir"),
        (["node", "--listen", "127.0.0.1:0"], "--data-dir"),
    ],
)
def test_a_directory_in_use_is_refused_naming_it_and_its_holder(
    tmp_path: Path, command: list[str], option: str
) -> None:
    with lock_directory(option, tmp_path):
        code, stderr = run(*command, option, str(tmp_path))
    assert code == 1
    line = only_line(stderr)
    assert line.startswith(f"{command[0]}: {option} {tmp_path}: in use by another")
    assert f"(pid {os.getpid()})" in line
    assert not list(tmp_path.glob("vb-*"))  # nothing written beside the holder


def test_the_lock_goes_with_its_holder(tmp_path: Path) -> None:
    with lock_directory("--state-dir", tmp_path):
        pass
    with lock_directory("--state-dir", tmp_path):
        assert (tmp_path / LOCK_NAME).stat().st_mode & 0o777 == 0o600


async def test_a_second_serve_on_a_served_state_dir_stops_at_start_up(tmp_path: Path) -> None:
    options = ServeOptions(
        tap_listen=("127.0.0.1", 0),
        upr_listen=("127.0.0.1", 0),
        metrics_listen=None,
        state_dir=tmp_path,
        embedded_sample_items=10,
        embedded_writes_per_second=0,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(run_serve, options)
        with pytest.raises(BaseException) as raised:
            await run_serve(options)
        error = startup_error_in(raised.value)
        assert error is not None and ": in use by another" in str(error)
        nursery.cancel_scope.cancel()
    # Released on the way out: the next start takes it.
    with lock_directory("--state-dir", tmp_path):
        pass


async def test_the_first_log_line_says_version_upstreams_and_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = ServeOptions(
        upr_upstream=("127.0.0.1", 9),
        tap_listen=("127.0.0.1", 0),
        metrics_listen=None,
        state_dir=tmp_path,
    )
    with caplog.at_level(logging.INFO):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_serve, options)
            nursery.cancel_scope.cancel()
    assert caplog.messages[0] == (
        f"{describe()} starting (pid {os.getpid()}): TAP front from --upr-upstream "
        f"127.0.0.1:9; state in --state-dir {tmp_path.resolve()}"
    )
