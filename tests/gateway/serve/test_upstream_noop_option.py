"""``serve --upstream-noop-interval``: the TAP front's CONTROL set_noop_interval.

The value goes to the UPR upstream as a decimal string in CONTROL
``set_noop_interval`` (later 3.x ep-engine dcp-producer.cc
``DcpProducer::control`` reads it with ``parseUint32``; 3.0.0's
upr-producer.cc knew no such key), so the option takes whole seconds from 1
to 2^32-1; anything else is refused before anything starts, with one line
naming the option and the value.
"""

from __future__ import annotations

import argparse

import pytest
import trio

from adapters.tap import ConnectFlags
from gateway.cli import serve_args, settings
from gateway.cli.main import _commands, build_parser
from gateway.cli.serve import ServeOptions, run_serve
from gateway.fronts.tap.upstream import DEFAULT_NOOP_INTERVAL
from tests.support.scripted_upr import Channel, Request, ScriptedUpr, stream_ok
from tests.support.tap_client import TapClient, connect_event, until

ANY_PORT = ("127.0.0.1", 0)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    settings.load(argv, _commands(parser), {})
    return parser.parse_args(argv)


def test_the_option_and_its_default() -> None:
    assert parse(["serve", "--upstream-noop-interval", "30"]).upstream_noop_interval == 30
    assert parse(["serve"]).upstream_noop_interval is None  # the front's default
    assert serve_args.DEFAULT_UPSTREAM_NOOP_INTERVAL == DEFAULT_NOOP_INTERVAL  # said in --help


@pytest.mark.parametrize("bad", ["0", "-5", "1.5", "soon", str(2**32)])
def test_a_bad_value_is_one_line(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["serve", f"--upstream-noop-interval={bad}"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("tap-upr-gateway serve: error: argument --upstream-noop-interval: ")
    assert bad in last


async def test_the_interval_reaches_the_upstream(nursery: trio.Nursery) -> None:
    async def play(channel: Channel, req: Request) -> None:
        await channel.send(stream_ok(req))

    upr = ScriptedUpr(play)
    port = await nursery.start(upr.serve)
    options = ServeOptions(
        tap_listen=ANY_PORT,
        upr_upstream=("127.0.0.1", port),
        metrics_listen=None,
        upstream_noop_interval=7,
    )
    running = await nursery.start(run_serve, options)
    assert running.tap_port
    connect = connect_event(b"noopy", ConnectFlags.LIST_VBUCKETS, vbuckets=(0,))
    with trio.fail_after(20):
        async with await TapClient.open(running.tap_port, connect):
            await until(lambda: len(upr.requests) == 1)
    assert upr.controls[b"set_noop_interval"] == b"7"
