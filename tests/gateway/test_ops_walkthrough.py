"""What a new operator trips over on a first run, answered where it happens.

An address given as a bare port or as a URL, embedded-node options beside a
real upstream (they change nothing), and the quick start's own command
warning about a temporary log that nothing else there outlives either.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from gateway.cli import settings
from gateway.cli.main import _commands, build_parser, main
from gateway.cli.serve import ServeOptions, run_serve
from gateway.cli.serve_args import _warn_embedded_only
from gateway.node.store import Store

ANY_PORT = ("127.0.0.1", 0)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    settings.load(argv, _commands(parser), {})
    return parser.parse_args(argv)


def refused(argv: list[str]) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    (line,) = err.getvalue().splitlines()
    return line


def test_a_bare_port_asks_for_a_host() -> None:
    assert refused(["serve", "--metrics-listen", "9464"]) == (
        "tap-upr-gateway serve: error: argument --metrics-listen: '9464' has no host: "
        "write HOST:PORT, e.g. 127.0.0.1:9464 (this machine only) or 0.0.0.0:9464 "
        "(every interface)"
    )


@pytest.mark.parametrize("url", ["http://node3:11210", "couchbase://node3:11210/"])
def test_a_url_is_refused_with_the_host_port_in_it(url: str) -> None:
    scheme = url.partition("://")[0]
    assert refused(["serve", "--upr-upstream", url]) == (
        f"tap-upr-gateway serve: error: argument --upr-upstream: {url!r}: write HOST:PORT "
        f"without the {scheme}:// part, e.g. node3:11210"
    )


def test_embedded_options_beside_an_upstream_are_said_to_do_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = parse(
        ["serve", "--upr-upstream", "node3:11210", "--vbucket-count", "1024",
         "--writes-per-second", "0.5"]
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        _warn_embedded_only(args)
    assert [r.getMessage() for r in caplog.records] == [
        "--vbucket-count 1024, --writes-per-second 0.5: only for the embedded node, which "
        "does not run when --upr-upstream or --tap-upstream is given; ignored"
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--vbucket-count", "8"],  # they are what the embedded node runs with
        ["serve", "--tap-upstream", "node1:11210"],  # defaults: nothing was asked
    ],
)
def test_no_warning_when_the_embedded_options_mean_something(
    caplog: pytest.LogCaptureFixture, argv: list[str]
) -> None:
    with caplog.at_level(logging.WARNING):
        _warn_embedded_only(parse(argv))
    assert caplog.records == []


async def test_the_quick_start_does_not_warn_about_its_temporary_log(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    options = ServeOptions(
        tap_listen=ANY_PORT,
        upr_listen=ANY_PORT,
        metrics_listen=None,
        embedded_sample_items=0,
        embedded_writes_per_second=0,
    )
    with caplog.at_level(logging.INFO):
        with trio.fail_after(30):
            await nursery.start(run_serve, options)
    (said,) = [r for r in caplog.records if "removed on exit" in r.getMessage()]
    assert said.levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    nursery.cancel_scope.cancel()


def test_a_data_dir_of_another_vbucket_count_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    data = tmp_path / "data"
    Store(4, data_dir=data).close()
    for path in [data, *data.rglob("*")]:  # as the command makes them (umask 077)
        path.chmod(0o700 if path.is_dir() else 0o600)
    node = ["node", "--listen", "127.0.0.1:0", "--data-dir", str(data)]
    done = subprocess.run(
        [sys.executable, "-m", "gateway", *node], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line == (
        f"node: --data-dir {data}: cannot recover the store: {data / 'store.journal'} holds "
        "4 vbuckets, configured 64 (--vbucket-count 64)"
    )


@contextmanager
def answering(reply: Callable[[bytes], bytes]) -> Iterator[int]:
    """A loopback server that answers each memcached request header with ``reply``."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                buffered = b""
                while data := conn.recv(65536):
                    buffered += data
                    while len(buffered) >= 24:
                        size = 24 + int.from_bytes(buffered[8:12], "big")
                        if len(buffered) < size:
                            break
                        conn.sendall(reply(buffered[:24]))
                        buffered = buffered[size:]

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        thread.join(timeout=30)


def http(_: bytes) -> bytes:
    return b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"


def response(header: bytes, status: int = 0, key: bytes = b"", value: bytes = b"") -> bytes:
    return (
        bytes([0x81, header[1]])
        + len(key).to_bytes(2, "big")
        + bytes(2)
        + status.to_bytes(2, "big")
        + (len(key) + len(value)).to_bytes(4, "big")
        + header[12:16]
        + bytes(8)
        + key
        + value
    )


def unknown_command(header: bytes) -> bytes:
    """What the gateway's fronts answer: STAT, but no SET (status 0x81)."""
    if header[1] == 0x10:  # STAT vbucket-seqno: one vbucket, then the end
        return response(header, key=b"vb_0:high_seqno", value=b"0") + response(header)
    return response(header, status=0x81)


def run_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("command", ["stats", "load"])
def test_a_client_pointed_at_an_http_port_is_told_so(command: str) -> None:
    with answering(http) as port:
        target = f"127.0.0.1:{port}"
        argv = ["stats", target, "vbucket"] if command == "stats" else [
            "load", "--target", target, "--items", "3"
        ]  # fmt: skip
        code, stderr = run_main(argv)
    assert code == 1
    assert stderr == (
        f"{command}: {target}: speaks HTTP, not the memcached binary protocol (a metrics or "
        "REST port? a node's data port is 11210)\n"
    )


def test_loading_what_takes_no_writes_says_to_load_a_node() -> None:
    with answering(unknown_command) as port:
        code, stderr = run_main(["load", "--target", f"127.0.0.1:{port}", "--items", "3"])
    assert code == 1
    assert stderr == (
        f"load: 127.0.0.1:{port} takes no writes (unknown_command): give a node's data port\n"
    )
