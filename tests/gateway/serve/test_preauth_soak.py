"""Soak (``-m slow``): peers that never authenticate cannot make the gateway buffer big
frames. 80 connections (40 per front) each declare a 20 MiB body before SASL and
push as much of it as the gateway reads; the gateway's RSS is read from /proc.

Prints the RSS before and with the 80 connections pushing. ``SOAK_GATEWAY_PATH``
runs the gateway from another checkout (to compare with an older version).
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from adapters.mcbp import Magic, Opcode

CONNECTIONS_PER_FRONT = 40
DECLARED = 20 * 1024 * 1024
CHUNK = 1024 * 1024


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert found is not None
    return int(found.group(1)) * 1024


async def push_unauthenticated_frame(port: int, pushed: list[int], done: trio.Event) -> None:
    """Declare a 20 MiB SASL_AUTH body and send it until the gateway stops reading."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    header = struct.pack(">BBHBBHIIQ", Magic.REQUEST, Opcode.SASL_AUTH, 5, 0, 0, 0, DECLARED, 1, 0)
    sent = 0
    try:
        await stream.send_all(header)
        chunk = b"x" * CHUNK
        while sent + CHUNK < DECLARED:
            await stream.send_all(chunk)
            sent += CHUNK
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        pushed.append(sent)
        if len(pushed) == 2 * CONNECTIONS_PER_FRONT:
            done.set()
    # Hold the connection (what the gateway kept for it stays counted) until cancelled.
    await trio.sleep_forever()


@pytest.mark.slow
async def test_80_unauthenticated_connections_cannot_grow_the_gateway(tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.write_text("someone:secret\n")
    code = os.environ.get("SOAK_GATEWAY_PATH", os.getcwd())
    env = {**os.environ, "PYTHONPATH": code}
    command = [
        sys.executable, "-m", "gateway", "serve", "--users", str(users), "--vbucket-count", "4",
        "--sample-items", "0", "--writes-per-second", "0", "--no-metrics",
        "--tap-listen", "127.0.0.1:0", "--upr-listen", "127.0.0.1:0",
        "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=code)
    watchdog = threading.Timer(300, process.kill)
    watchdog.start()
    try:
        assert process.stderr is not None
        ports: list[int] = []
        for line in process.stderr:
            found = re.search(r"(?:TAP|UPR) front listening on \S+?:(\d+)", line)
            if found:
                ports.append(int(found.group(1)))
            if len(ports) == 2:
                break
        # Drain the log so the gateway never blocks on a full pipe.
        threading.Thread(target=process.stderr.read, daemon=True).start()
        before = rss_bytes(process.pid)
        pushed: list[int] = []
        done = trio.Event()
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                for port in ports:
                    for _ in range(CONNECTIONS_PER_FRONT):
                        nursery.start_soon(push_unauthenticated_frame, port, pushed, done)
                await done.wait()
                during = rss_bytes(process.pid)
                nursery.cancel_scope.cancel()
        print(
            f"\ngateway RSS: {before / 2**20:.0f} MiB before, {during / 2**20:.0f} MiB with "
            f"{len(pushed)} unauthenticated connections pushing 20 MiB frames "
            f"({sum(pushed) / 2**20:.0f} MiB sent in all)"
        )
        assert during - before < 64 * 2**20
    finally:
        watchdog.cancel()
        process.kill()
        process.wait()
