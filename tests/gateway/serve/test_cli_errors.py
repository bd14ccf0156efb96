"""What an operator sees when a command is given something it cannot use.

Each case runs the real command in a process and checks for one line on
stderr naming the option (or path, or address) and the reason, the exit
status, and no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

GATEWAY = [sys.executable, "-m", "gateway"]
FREE = ["--tap-listen", "127.0.0.1:0", "--upr-listen", "127.0.0.1:0", "--no-metrics"]


def run(
    *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> tuple[int, str]:
    done = subprocess.run([*GATEWAY, *args], input=stdin, capture_output=True, timeout=60, env=env)
    return done.returncode, done.stderr.decode()


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr
    return lines[-1]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["node", "--vbucket-count", "0"],
            "argument --vbucket-count: 0 is not between 1 and 65536",
        ),
        (
            ["node", "--vbucket-count", "70000"],
            "argument --vbucket-count: 70000 is not between 1 and 65536",
        ),
        (
            ["serve", "--vbucket-count", "0"],
            "argument --vbucket-count: 0 is not between 1 and 65536",
        ),
        (
            ["serve", "--vbuckets", "0-3"],
            "argument --vbuckets: '0-3' is a list of vbucket ids, but --vbucket-count takes how "
            "many vbuckets the node has (e.g. 64); lists go to --vbuckets of move and capture",
        ),
        (["node", "--sample-items", "-5"], "argument --sample-items: -5 is not at least 0"),
        (["serve", "--sample-items", "-5"], "argument --sample-items: -5 is not at least 0"),
        (
            ["serve", "--writes-per-second", "-1"],
            "argument --writes-per-second: -1 is not at least 0",
        ),
        (["node", "--listen", ":11210"], "argument --listen: ':11210' has no host"),
        (["serve", "--tap-listen", "h:x"], "argument --tap-listen: bad address 'h:x'"),
        (["load", "--items", "-1"], "argument --items: -1 is not at least 0"),
    ],
)
def test_bad_arguments_are_refused_at_parse_time(args: list[str], expected: str) -> None:
    code, stderr = run(*args)
    assert code == 2
    assert expected in one_line(stderr)


def test_a_state_dir_that_is_a_file_is_named(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    code, stderr = run("serve", *FREE, "--state-dir", str(afile), "--sample-items", "5")
    assert code == 1
    assert one_line(stderr) == f"serve: --state-dir {afile}: exists and is not a directory"


def test_a_data_dir_that_is_a_file_is_named_not_the_listen_address(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    code, stderr = run("node", "--listen", "127.0.0.1:0", "--data-dir", str(afile))
    assert code == 1
    assert one_line(stderr) == f"node: --data-dir {afile}: exists and is not a directory"


def test_an_unresolvable_listen_host_is_named(tmp_path: Path) -> None:
    code, stderr = run(
        "serve", "--tap-listen", "999.1.1.1:11212", "--upr-listen", "127.0.0.1:0",
        "--no-metrics", "--state-dir", str(tmp_path), "--sample-items", "5",
    )  # fmt: skip
    assert code == 1
    assert one_line(stderr).startswith(
        "serve: --tap-listen 999.1.1.1:11212: cannot resolve host '999.1.1.1'"
    )


def test_the_metrics_port_in_use_names_the_metrics_option(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, stderr = run(
            "serve", "--tap-listen", "127.0.0.1:0", "--upr-listen", "127.0.0.1:0",
            "--metrics-listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path),
            "--sample-items", "5",
        )  # fmt: skip
    assert code == 1
    assert one_line(stderr) == (
        f"serve: --metrics-listen 127.0.0.1:{port}: address already in use "
        "(another process listens there)"
    )
    assert "listening on" not in stderr


def test_decode_odd_length_hex_says_so() -> None:
    code, stderr = run("decode", "--hex", stdin=b"804")
    assert code == 2
    assert one_line(stderr) == (
        "decode: hex text has an odd number of digits (3): the last byte is cut short"
    )


def test_decode_names_a_character_that_is_not_hex() -> None:
    code, stderr = run("decode", "--hex", stdin=b"80 4g")
    assert code == 2
    assert "'g' is not a hex digit" in one_line(stderr)


def test_decode_of_hex_text_without_hex_suggests_the_flag() -> None:
    code, stderr = run("decode", stdin=b"80410005100000660000001a")
    assert code == 2
    assert one_line(stderr).endswith("(the input looks like hex text: pass --hex)")


def _serve_until(args: list[str], pattern: str, env: dict[str, str]) -> str:
    """Run serve until a stderr line matches ``pattern``, then SIGINT; all of stderr."""
    process = subprocess.Popen(
        [*GATEWAY, "serve", *args], stderr=subprocess.PIPE, text=True, env=env
    )
    watchdog = threading.Timer(60, process.kill)
    watchdog.start()
    seen: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:
            seen.append(line)
            if re.search(pattern, line):
                break
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        seen.append(process.stderr.read())
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
    return "".join(seen)


def test_a_temporary_state_dir_is_removed_on_exit(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = _serve_until(
        [*FREE, "--sample-items", "5", "--writes-per-second", "0"], r"UPR front listening", env
    )
    assert "removed on exit" in out and "Traceback" not in out
    assert not list(tmp_path.glob("tap-upr-gateway-*"))


def test_an_unreachable_upstream_is_reported_at_start_up(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = closed.getsockname()[1]
        out = _serve_until(
            [*FREE, "--upr-upstream", f"127.0.0.1:{port}"],
            r"is unreachable",
            dict(os.environ),
        )
    reason = "connection refused (nothing listens there)"
    assert f"--upr-upstream 127.0.0.1:{port} is unreachable: {reason}" in out
