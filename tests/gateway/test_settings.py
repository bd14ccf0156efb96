"""Option values from --config (TOML) and TAP_UPR_GATEWAY_* variables, below the command line."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import settings
from gateway.cli.main import _commands, build_parser


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    settings.load(argv, _commands(parser), environ or {})
    return parser.parse_args(argv)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def test_command_line_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        'log-format = "json"\nfsync = "never"\n'
        '[serve]\nsample-items = 7\nwrites_per_second = 0\nstate-dir = "/srv/gw"\n'
        "per-vbucket-metrics = true\n",
    )
    env = {"TAP_UPR_GATEWAY_SAMPLE_ITEMS": "9"}
    args = parse(["serve", "--config", str(config)], env)
    assert (args.sample_items, args.writes_per_second) == (9, 0.0)
    assert (args.log_format, args.fsync, args.state_dir) == ("json", "never", Path("/srv/gw"))
    assert args.per_vbucket_metrics is True
    assert parse(["serve", "--config", str(config), "--sample-items", "3"], env).sample_items == 3
    assert parse(["serve"]).sample_items == 10_000


def test_a_required_option_may_come_from_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, '[load]\nitems = 5\ntarget = "127.0.0.1:11299"\n')
    args = parse(["load", "--config", str(config)])
    assert (args.items, args.target) == (5, ("127.0.0.1", 11299))


def test_lists_and_booleans_from_the_environment() -> None:
    env = {"TAP_UPR_GATEWAY_REPLICA_VBUCKETS": "0-2,5", "TAP_UPR_GATEWAY_NO_METRICS": "yes"}
    assert parse(["node"], env).replica_vbuckets == [0, 1, 2, 5]
    assert parse(["serve"], env).no_metrics is True


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[node]\nvbuckets = 0\n", {}, "[node] vbuckets: --vbuckets: 0 is not between 1 and 65536"),
        ("[node]\nbogus = 1\n", {}, "[node] 'bogus' is no option of node"),
        ("nonsense = 1\n", {}, "'nonsense' is no option of any command"),
        ("[node\n", {}, "not valid TOML"),
        (
            "",
            {"TAP_UPR_GATEWAY_FSYNC": "sometimes"},
            "$TAP_UPR_GATEWAY_FSYNC: --fsync: 'sometimes'",
        ),
        ("", {"TAP_UPR_GATEWAY_NO_METRICS": "maybe"}, "--no-metrics is true or false"),
    ],
)
def test_bad_settings_are_one_line_naming_where_they_came_from(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    config = write(tmp_path, text)
    command = "serve" if "METRICS" in "".join(env) else "node"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", command, "--config", str(config)],
        capture_output=True, text=True, timeout=60, env={**_base_env(), **env},
    )  # fmt: skip
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert message in last and "Traceback" not in done.stderr


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(settings.ENV_PREFIX)}


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "node", "--config", str(missing)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        f"--config {missing}: cannot read it: No such file or directory"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["capture", "--tap", "127.0.0.1:11210", "--out", "/tmp/c", "--user", "ops"],
        ["load", "--target", "127.0.0.1:11299", "--items", "1", "--user", "ops"],
    ],
)
def test_client_passwords_never_need_the_command_line(argv: list[str]) -> None:
    args = parse(argv, {"TAP_UPR_GATEWAY_PASSWORD": "s3cret"})
    assert (args.user, args.password) == ("ops", "s3cret")
    help_text = _commands(build_parser())[argv[0]].format_help()
    assert "TAP_UPR_GATEWAY_PASSWORD" in help_text
