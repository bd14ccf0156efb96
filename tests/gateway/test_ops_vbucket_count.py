"""``--vbucket-count N`` (serve, node) against ``--vbuckets LIST`` (move, capture).

``--vbuckets`` was a count in serve and node and a list of vbucket ids in move
and capture; the count has its own name now. The old one is still accepted
for a count, with one warning line naming the new one, and a list given to
the count is refused in one line naming both options.
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from gateway.cli import settings
from gateway.cli.main import _commands, build_parser, main
from gateway.runtime import logs

BOTH = "--vbucket-count takes how many vbuckets the node has (e.g. 64); lists go to --vbuckets"


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    settings.load(argv, _commands(parser), environ or {})
    return parser.parse_args(argv)


def refused(argv: list[str]) -> str:
    """The one stderr line of a usage error (exit status 2)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "node"])
def test_the_count_has_its_own_name(command: str) -> None:
    args = parse([command, "--vbucket-count", "8"])
    assert args.vbucket_count == 8
    assert not getattr(args, "deprecation_notes", [])
    assert parse([command]).vbucket_count == 64


@pytest.mark.parametrize("command", ["serve", "node"])
def test_the_old_name_still_counts_and_says_what_to_write(command: str) -> None:
    args = parse([command, "--vbuckets", "8"])
    assert args.vbucket_count == 8
    assert args.deprecation_notes == [
        f"{command}: --vbuckets 8 is deprecated: write --vbucket-count 8 "
        "(--vbuckets is a list of vbucket ids in move and capture)"
    ]


@pytest.mark.parametrize("command", ["serve", "node"])
@pytest.mark.parametrize("option", ["--vbucket-count", "--vbuckets"])
@pytest.mark.parametrize("value", ["0,1,5", "0-3", "4,"])
def test_a_list_given_to_the_count_names_both_options(
    command: str, option: str, value: str
) -> None:
    line = refused([command, option, value])
    assert line.startswith(f"tap-upr-gateway {command}: error: argument {option}: {value!r}")
    assert BOTH in line


def test_move_and_capture_keep_the_list() -> None:
    move = ["move", "--from-tap", "127.0.0.1:1", "--to-upr", "127.0.0.1:2", "--vbuckets", "0-2,5"]
    assert parse(move).vbuckets == [0, 1, 2, 5]
    capture = parse(["capture", "--tap", "127.0.0.1:1", "--out", "d", "--vbuckets", "0-2"])
    assert list(capture.vbuckets) == [0, 1, 2]


def test_help_shows_only_the_new_name() -> None:
    commands = _commands(build_parser())
    for command in ("serve", "node"):
        text = commands[command].format_help()
        assert "--vbucket-count N" in text
        assert "--vbuckets" not in text
    for command in ("move", "capture"):
        assert "--vbuckets LIST" in commands[command].format_help()


def test_the_warning_is_one_log_line_in_the_chosen_format() -> None:
    args = parse(["node", "--vbuckets", "4", "--log-format", "json"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        logs.configure_from(args)
    lines = err.getvalue().splitlines()
    assert len(lines) == 1
    assert '"level": "warning"' in lines[0]
    assert "write --vbucket-count 4" in lines[0]


def test_the_old_name_from_the_environment_is_named_there() -> None:
    args = parse(["serve"], {"TAP_UPR_GATEWAY_VBUCKETS": "16"})
    assert args.vbucket_count == 16
    (note,) = args.deprecation_notes
    assert note.startswith("serve: --vbuckets 16 ($TAP_UPR_GATEWAY_VBUCKETS) is deprecated")
    assert parse(["serve"], {"TAP_UPR_GATEWAY_VBUCKET_COUNT": "16"}).vbucket_count == 16
