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
import subprocess
import sys
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
    data.chmod(0o700)
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
