"""Child processes the kill -9 tests start: a script run by this Python with the
project on its path, which prints the port it listens on once it listens; and
``stop``, how a test ends a child it started."""

from __future__ import annotations

import os
import subprocess
import sys

import trio


async def start_listening(
    script: str, *args: object, what: str = "the child"
) -> tuple[trio.Process, int]:
    """``python -c script args...``, once it printed its port (a line of its own);
    fails if it exits first or takes more than 30 s."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    line = b""
    with trio.fail_after(30):
        while not line.endswith(b"\n"):
            more = await proc.stdout.receive_some(100)
            assert more, f"{what} exited before listening"
            line += more
    return proc, int(line)


def stop(process: subprocess.Popen[str], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if ``process`` has not exited after ``timeout`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
