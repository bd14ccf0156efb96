"""The capture command: argument parsing, a run to completion, and SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from gateway.node.store import Store
from gateway.tools.capture import read_capture
from gateway.tools.capture.command import add_capture_parser, options_from, two_sided_options
from tests.support.tap_client import start_node

ROOT = Path(__file__).resolve().parents[4]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="tap-upr-gateway")
    add_capture_parser(top.add_subparsers(dest="command", required=True))
    return top


def test_arguments() -> None:
    args = parser().parse_args(
        [
            "capture",
            "--upr",
            "127.0.0.1:11210",
            "--out",
            "d",
            "--vbuckets",
            "0-2,7",
            "--dialect",
            "upr-draft",
            "--until-caught-up",
            "--segment-mb",
            "2",
        ]
    )
    side, options = options_from(args)
    assert side == "upr" and options.vbuckets == (0, 1, 2, 7) and options.until_caught_up
    assert options.max_segment_bytes == 2 * 1024 * 1024 and options.dialect == "upr-draft"
    both = parser().parse_args(["capture", "--tap", "h:1", "--upr", "h:2", "--out", "d"])
    tap, upr = two_sided_options(both)
    assert (tap.port, tap.out, upr.port, upr.out) == (1, Path("d/tap"), 2, Path("d/upr"))
    for bad in (
        ["capture", "--tap", "h:x", "--out", "d"],
        ["capture", "--tap", "h:1", "--out", "d", "--vbuckets", "a"],
    ):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)


def _command(port: int, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway.tools.capture",
        "capture",
        "--upr",
        f"127.0.0.1:{port}",
        "--out",
        str(out),
        *extra,
    ]


async def test_until_caught_up_and_sigterm(nursery: trio.Nursery, tmp_path: Path) -> None:
    store = Store(4)
    store.populate_sample(200, now=time.time())
    _, port = await start_node(nursery, store)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = await trio.run_process(
        _command(port, tmp_path / "once", "--until-caught-up"), capture_stdout=True, env=env
    )
    assert b"caught-up; 200 items" in done.stdout
    refused = await trio.run_process(
        [
            sys.executable,
            "-m",
            "gateway.tools.capture",
            "capture",
            "--tap",
            "127.0.0.1:1",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_stderr=True,
        check=False,
        env=env,
    )
    assert refused.returncode == 1 and b"capture: 127.0.0.1:1:" in refused.stderr

    live = tmp_path / "live"
    process = await trio.lowlevel.open_process(
        _command(port, live), env=env, stdout=subprocess.PIPE
    )
    try:
        with trio.fail_after(20):
            while (
                sum(len(s.records) for _, s in read_capture(live)) < 200 if live.exists() else True
            ):
                await trio.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    assert code == 0
    segments = list(read_capture(live))
    assert all(segment.torn is None for _, segment in segments)
    assert sum(len(s.records) for _, s in segments) >= 200


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gateway.tools.capture", "capture", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_unwritable_out_and_no_endpoint_exit_non_zero(tmp_path: Path) -> None:
    """Operators' scripts rely on the exit status: nothing recorded is never success."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    got = _run_cli("--upr", "127.0.0.1:1", "--out", str(a_file))
    assert got.returncode == 1
    assert got.stderr.strip() == f"capture: --out {a_file}: exists and is not a directory"
    got = _run_cli("--out", str(tmp_path / "d"))
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and "--tap" in got.stderr


def test_dropped_records_or_a_closed_server_are_incomplete() -> None:
    from gateway.tools.capture.command import _incomplete
    from gateway.tools.capture.session import CaptureResult

    def result(stopped: str, dropped: int = 0) -> CaptureResult:
        done = CaptureResult("upr", "c", [0], {0: 5}, stopped=stopped)
        done.dropped = dropped
        return done

    assert _incomplete(result("caught-up"), until=True) is None
    assert _incomplete(result("stopped"), until=False) is None
    assert "628 records dropped" in str(_incomplete(result("stopped", 628), until=False))
    assert "closed" in str(_incomplete(result("server-closed"), until=False))
    assert "before every vbucket caught up" in str(_incomplete(result("stopped"), until=True))
