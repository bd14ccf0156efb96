"""Security as an operator sets it up, with the real commands in processes: hashed
users, the upstream password from a file or the environment, TLS on both sides,
private state, and a users file that would lock everyone out refused at start-up."""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from adapters.mcbp import Opcode
from adapters.tap import ConnectFlags, TapMutation, encode
from gateway.io.auth import read_users
from gateway.io.connection import PacketConnection
from gateway.io.tls import client_context
from tests.gateway.test_tls import make_certificate
from tests.support.tap_client import TapClient, connect_event

GATEWAY = [sys.executable, "-m", "gateway"]


def run(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = subprocess.run(
        [*GATEWAY, *args], input=stdin, capture_output=True, text=True, timeout=60, env=env
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("command", ["serve", "node"])
def test_an_empty_users_file_is_refused_at_start_up(tmp_path: Path, command: str) -> None:
    users = tmp_path / "users"
    users.write_text("# everyone was removed\n")
    code, _, stderr = run(command, "--users", str(users))
    assert code == 2
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert lines == [
        f"{command}: --users {users}: no users in it; every client would be refused "
        "(add user:password lines, or leave out --users to require no authentication)"
    ]


def test_hash_password_reads_stdin_and_prints_a_users_file_secret(tmp_path: Path) -> None:
    code, out, stderr = run("hash-password", "--iterations", "1000", stdin="pa:ss word\n")
    assert code == 0, stderr
    secret = out.strip()
    assert secret.startswith("pbkdf2_sha256$1000$")
    assert "pa:ss word" not in out
    code, line, _ = run(
        "hash-password", "--user", "ops", "--admin", "--iterations", "1000", stdin="root\n"
    )
    assert code == 0
    users_file = tmp_path / "users"
    users_file.write_text(f"app:{secret}\n{line}")
    users = read_users(users_file)
    assert users.verify("app", "pa:ss word") is not None
    assert users.verify("ops", "root") is not None
    assert users.may_administer("ops") and not users.may_administer("app")
    code, _, stderr = run("hash-password", stdin="")
    assert (code, stderr.strip()) == (1, "hash-password: no password on stdin")


@contextmanager
def process(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([*GATEWAY, *args], stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(90, proc.kill)  # one that never starts ends the reads
    watchdog.start()
    try:
        yield proc
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def wait_for(
    proc: subprocess.Popen[str], pattern: str, count: int = 1, seen: list[str] | None = None
) -> list[int]:
    """Ports from the first ``count`` log lines matching ``pattern`` (a port group);
    the lines read go to ``seen``."""
    assert proc.stderr is not None
    ports: list[int] = []
    seen = [] if seen is None else seen
    for line in proc.stderr:
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            ports.append(int(found.group(1)))
            if len(ports) == count:
                return ports
    raise AssertionError("".join(seen))


def tls_client(cert: Path) -> ssl.SSLContext:
    return client_context(cert)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
async def test_a_locked_down_deployment_end_to_end(tmp_path: Path) -> None:
    """Node and gateway with hashed users, TLS everywhere, the upstream password from
    a file and from the environment, and a state dir that ends up private."""
    cert, key = make_certificate(tmp_path)
    secret = run("hash-password", "--iterations", "1000", stdin="gw-pass\n")[1].strip()
    client_secret = run("hash-password", "--iterations", "1000", stdin="old-pass\n")[1].strip()
    node_users = tmp_path / "node-users"
    node_users.write_text(f"gateway:{secret}\n")
    front_users = tmp_path / "front-users"
    front_users.write_text(f"replica:{client_secret}\nadmin ops:plain-admin\n")
    front_users.chmod(0o600)
    password_file = tmp_path / "upstream-password"
    password_file.write_text("gw-pass\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    with process(
        ["node", "--listen", "127.0.0.1:0", "--users", str(node_users), "--vbucket-count", "4",
         "--sample-items", "200", *tls],
        env,
    ) as node:  # fmt: skip
        (node_port,) = wait_for(node, r"reference node listening on 127\.0\.0\.1:(\d+)")
        for password_option, extra_env in (
            (["--upstream-password-file", str(password_file)], {}),
            ([], {"TAP_UPR_GATEWAY_UPSTREAM_PASSWORD": "gw-pass"}),
        ):
            upstream = f"127.0.0.1:{node_port}"
            with process(
                ["serve", "--upr-upstream", upstream, "--tap-upstream", upstream,
                 "--upstream-user", "gateway", *password_option, "--upstream-tls",
                 "--upstream-ca", str(cert), "--users", str(front_users), *tls,
                 "--tap-listen", "127.0.0.1:0", "--upr-listen", "127.0.0.1:0", "--no-metrics",
                 "--state-dir", str(state)],
                {**env, **extra_env},
            ) as serve:  # fmt: skip
                log: list[str] = []
                tap_port, _ = wait_for(serve, r"(?:TAP|UPR) front listening on \S+?:(\d+)", 2, log)
                with trio.fail_after(30):
                    client = await PacketConnection.connect(
                        "127.0.0.1", tap_port, ssl_context=tls_client(cert)
                    )
                    await client.sasl_plain("replica", "old-pass")
                    await client.send(
                        encode(connect_event(b"r", ConnectFlags.DUMP | ConnectFlags.BACKFILL,
                                             backfill_date=0))
                    )  # fmt: skip
                    events = await TapClient(client.stream).collect()
                    keys = {e.key for e in events if isinstance(e, TapMutation)}
                    assert {b"sample::%06d" % i for i in range(200)} <= keys
                    await client.aclose()
                    admin = await PacketConnection.connect(
                        "127.0.0.1", tap_port, ssl_context=tls_client(cert)
                    )
                    await admin.sasl_plain("ops", "plain-admin")
                    await admin.request(Opcode.DEREGISTER_TAP_CLIENT, key=b"r")
                    await admin.aclose()
                serve.send_signal(signal.SIGTERM)
                assert serve.wait(timeout=30) == 0
                assert serve.stderr is not None
                rest = "".join(log) + serve.stderr.read()
                assert "Traceback" not in rest
                assert "gw-pass" not in rest
                if not extra_env:  # the first run found the directory open
                    assert f"--state-dir {state} was open to other users (mode 755)" in rest
    modes = {path: path.stat().st_mode & 0o777 for path in [state, *state.rglob("*")]}
    assert len(modes) > 3  # the UPR front's log was written
    for path, mode in modes.items():
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


GONE = "/nonexistent"
UNREADABLE = "cannot read it: No such file or directory"
MOVE = ["move", "--from-tap", "127.0.0.1:1", "--to-upr", "127.0.0.1:2", "--vbuckets", "1"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--tls-cert", f"{GONE}/c.pem"], f"serve: --tls-cert {GONE}/c.pem: no such file"),
        (["node", "--tls-cert", f"{GONE}/c.pem"], f"node: --tls-cert {GONE}/c.pem: no such file"),
        (["serve", "--tls-key", "/tmp/k.pem"], "serve: --tls-key /tmp/k.pem: needs --tls-cert"),
        (
            ["serve", "--upstream-ca", "/tmp/ca.pem"],
            "serve: --upstream-ca /tmp/ca.pem: needs --upstream-tls",
        ),
        (
            ["serve", "--upstream-tls", "--upstream-ca", f"{GONE}/ca.pem"],
            f"serve: --upstream-ca {GONE}/ca.pem: no such file",
        ),
        (
            ["serve", "--upstream-user", "u", "--upstream-password-file", f"{GONE}/pw"],
            f"serve: --upstream-password-file {GONE}/pw: {UNREADABLE}",
        ),
        (
            [*MOVE, "--upstream-user", "u", "--upstream-password-file", f"{GONE}/pw"],
            f"move: --upstream-password-file {GONE}/pw: {UNREADABLE}",
        ),
        (
            ["serve", "--upstream-tls"],
            "serve: --upstream-tls needs --upr-upstream or --tap-upstream "
            "(the embedded node speaks plain TCP)",
        ),
        (["serve", "--max-connections", "0"], "argument --max-connections: 0 is not at least 1"),
        (
            ["serve", "--handshake-timeout", "-1"],
            "argument --handshake-timeout: -1 is not at least 0.001",
        ),
    ],
)
def test_unusable_security_options_are_refused_in_one_line(args: list[str], expected: str) -> None:
    code, _, stderr = run(*args)
    assert code == 2
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].endswith(expected)
