"""A new operator's mistakes on the command line: each is one line naming the command,
the option and what is wrong, exit status 2, no usage block and no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.main import main

GATEWAY = [sys.executable, "-m", "gateway"]


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(list(argv))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # The command the unknown option was given to, not the top level.
        (["serve", "--bogus"], "tap-upr-gateway serve: error: unrecognized arguments: --bogus"),
        (
            ["serve", "--state-dri", "/tmp/x"],
            "unrecognized arguments: --state-dri (did you mean --state-dir?) /tmp/x",
        ),
        (
            ["serve", "--upr-upstream", "node3"],
            "argument --upr-upstream: 'node3' has no port: write HOST:PORT, e.g. node3:11210",
        ),
        (
            ["serve", "--upr-upstream", "[::1"],
            "argument --upr-upstream: '[::1': unbalanced brackets",
        ),
        (["node", "--listen", "::1]:11210"], "argument --listen: '::1]:11210': unbalanced"),
        (["serve", "--tap-listen", "h:70000"], "port 70000 out of range"),
        (["stats"], "tap-upr-gateway stats: error: the following arguments are required"),
        ([], "tap-upr-gateway: error: the following arguments are required: COMMAND"),
    ],
)
def test_a_usage_mistake_is_one_line_naming_the_command(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert expected in usage_error(capsys, *argv)


def test_a_bracketed_ipv6_address_is_accepted() -> None:
    from gateway.cli.args import address

    assert address("[::1]:11210") == ("::1", 11210)


@pytest.mark.parametrize("command", ["stats", "vbucket"])
def test_help_shows_no_python_defaults(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_every_long_running_command_takes_the_logging_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("serve", "node", "move", "capture"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "--log-level" in out and "--log-format" in out, command


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(*argv: str) -> tuple[int, str]:
    done = subprocess.run([*GATEWAY, *argv], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr
    return done.returncode, done.stderr


def test_an_empty_password_file_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("\n")
    secret.chmod(0o600)
    target = f"127.0.0.1:{closed_port()}"
    code, err = run("capture", "--upr", target, "--out", str(tmp_path / "c"), "--user", "u",
                    "--password-file", str(secret))  # fmt: skip
    assert code == 2
    assert (
        err.strip()
        == f"capture: --password-file {secret}: empty: put the password on its first line"
    )


def test_a_missing_password_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    code, err = run("load", "--target", f"127.0.0.1:{closed_port()}", "--items", "1",
                    "--user", "u", "--password-file", str(missing))  # fmt: skip
    assert code == 2
    assert (
        err.strip() == f"load: --password-file {missing}: cannot read it: No such file or directory"
    )


def test_an_upstream_password_file_without_its_user_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    code, err = run("serve", "--no-metrics", "--upr-upstream", f"127.0.0.1:{closed_port()}",
                    "--upstream-password-file", str(secret))  # fmt: skip
    assert code == 2
    assert err.strip() == f"serve: --upstream-password-file {secret}: needs --upstream-user"


def test_a_password_file_others_can_read_is_warned_about(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    code, err = run("stats", f"127.0.0.1:{closed_port()}", "--user", "u",
                    "--password-file", str(secret))  # fmt: skip
    assert code == 1  # nothing listens there
    assert f"--password-file {secret} is readable by other users (mode 644): chmod 600 it" in err


def test_ctrl_c_before_a_command_runs_stops_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the command is still importing (about a second under load)."""
    import gateway.cli.main as cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["serve"]) == 130
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ["serve", "node", "move", "capture", "load", "check-log"])
def test_option_values_are_named_by_kind_not_by_python_name(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """`--state-dir DIR`, `--upstream-user USER`, as in the other commands, not
    `--state-dir STATE_DIR`."""
    import re

    with pytest.raises(SystemExit):
        main([command, "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    python_names = re.findall(r"--[a-z-]+ ([A-Z]+_[A-Z_]+)", usage)
    assert python_names == [], python_names


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (["move", "--from-tap", "{a}", "--to-upr", "{a}", "--vbuckets", "1"],
         "move: cannot reach the destination {a}: "),
        (["capture", "--upr", "{a}", "--out", "{out}"], "capture: {a}: "),
        (["load", "--target", "{a}", "--items", "1"], "load: cannot reach {a}: "),
    ],
)  # fmt: skip
def test_a_refused_connection_says_why_not_all_attempts_failed(
    tmp_path: Path, argv: list[str], prefix: str
) -> None:
    where = {"a": f"127.0.0.1:{closed_port()}", "out": str(tmp_path / "cap")}
    code, err = run(*(word.format(**where) for word in argv))
    assert code == 1
    assert err.strip() == prefix.format(**where) + "connection refused (nothing listens there)"
