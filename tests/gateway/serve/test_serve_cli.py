"""The README's main job, end to end: ``tap-upr-gateway serve`` as a process."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import trio

from adapters.tap import ConnectFlags, TapMutation
from tests.support.tap_client import TapClient, connect_event


async def test_serve_with_no_upstream_serves_tap_clients_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    command = [
        sys.executable, "-m", "gateway", "serve", "--tap-listen", "127.0.0.1:0",
        "--upr-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
        "--state-dir", str(tmp_path), "--vbucket-count", "8", "--sample-items", "300",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, process.kill)  # a gateway that never starts ends the read
    watchdog.start()
    try:
        assert process.stderr is not None
        ports: dict[str, int] = {}
        for line in process.stderr:
            found = re.search(
                r"(TAP front|UPR front|metrics on http://)\D*127\.0\.0\.1:(\d+)", line
            )
            if found:
                ports[found.group(1)] = int(found.group(2))
            if len(ports) == 3:
                break
        assert set(ports) == {"TAP front", "UPR front", "metrics on http://"}
        with trio.fail_after(20):
            client = await TapClient.open(
                ports["TAP front"],
                connect_event(b"cli", ConnectFlags.DUMP | ConnectFlags.BACKFILL, backfill_date=0),
            )
            events = await client.collect()
        keys = {e.key for e in events if isinstance(e, TapMutation)}
        assert {b"sample::%06d" % i for i in range(300)} <= keys
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        rest = process.stderr.read()
        assert "shutting down" in rest and "Traceback" not in rest
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_help_explains_the_fronts() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for option in (
        "--tap-listen",
        "--upr-upstream",
        "--tap-upstream",
        "--state-dir",
        "--metrics-listen",
    ):
        assert option in out


def test_move_needs_a_matching_destination() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "move", "--from-upr", "127.0.0.1:1", "--vbuckets", "1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--from-upr needs --to-tap" in done.stderr


def test_a_port_in_use_is_one_clear_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [
            sys.executable, "-m", "gateway", "serve", "--tap-listen", f"127.0.0.1:{port}",
            "--upr-listen", "127.0.0.1:0", "--no-metrics", "--state-dir", str(tmp_path),
            "--sample-items", "10",
        ]  # fmt: skip
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"serve: --tap-listen 127.0.0.1:{port}: address already in use "
        "(another process listens there)"
    )
    assert "Traceback" not in done.stderr
    assert "listening on" not in done.stderr  # nothing announced before every listener is bound
