"""State, data and capture directories that cannot be used are refused in one line
naming the option, the path and why (exit status 1, no traceback), before anything
is written; one open to other users is made 0700 with a warning only when it is
the gateway's own (empty, or used by it before), never a shared or foreign one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.startup import LOCK_NAME, StartupError, prepare_directory

GATEWAY = [sys.executable, "-m", "gateway"]
FREE = ["--tap-listen", "127.0.0.1:0", "--upr-listen", "127.0.0.1:0", "--no-metrics"]
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown or bind-mount")


def refusal(path: Path, option: str = "--state-dir") -> str:
    with pytest.raises(StartupError) as refused:
        prepare_directory(option, path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{option} {path}: ")
    return message.removeprefix(f"{option} {path}: ")


def only_line(stderr: str) -> str:
    """The error: the one line that is not a log line (serve logs its start first)."""
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not line[:4].isdigit()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_path_under_a_regular_file_names_the_file(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert refusal(afile / "state" / "deeper") == f"{afile} is a file, not a directory"


def test_a_place_whose_file_system_takes_no_directories_says_so() -> None:
    parent = Path(f"/proc/{os.getpid()}")
    assert refusal(parent / "state") == (
        f"cannot create it: {parent} does not take new directories (its file system refuses them)"
    )


@AS_ROOT
def test_a_directory_of_another_user_is_refused_untouched(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    reason = refusal(theirs)
    assert reason.startswith("owned by ")
    assert "(uid 65534) while this process runs as " in reason
    assert (theirs.stat().st_mode & 0o777, os.listdir(theirs)) == (0o755, [])


def test_a_shared_sticky_directory_is_refused_not_made_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    assert refusal(shared).startswith("shared by every user (mode 1777, as /tmp is): give ")
    assert shared.stat().st_mode & 0o7777 == 0o1777


def test_an_open_directory_holding_other_files_is_refused_not_made_private(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("")
    home.chmod(0o755)
    assert refusal(home) == (
        "open to other users (mode 755) and holds files the gateway did not make "
        f"(e.g. 'notes.txt'): give it a directory of its own, e.g. {home / 'tap-upr-gateway'}"
    )
    assert home.stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize(
    "left_before",
    [[], [LOCK_NAME, "vb-0000/"], ["store.journal"], ["tap/", "upr/"], ["a.000000.tucap"]],
)
def test_its_own_directory_open_to_others_is_made_private_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, left_before: list[str]
) -> None:
    """Empty, or holding what the gateway writes (state, node data, captures)."""
    state = tmp_path / "state"
    state.mkdir()
    for name in left_before:
        if name.endswith("/"):
            (state / name).mkdir()
        else:
            (state / name).write_text("")
    state.chmod(0o750)
    with caplog.at_level(logging.WARNING):
        assert prepare_directory("--state-dir", state) == state
    assert state.stat().st_mode & 0o777 == 0o700
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"--state-dir {state} was open to other users (mode 750): made it 0700"
    assert all(p.stat().st_mode & 0o077 == 0 for p in state.rglob("*"))  # made private too


def test_a_new_directory_is_private_and_the_check_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "a" / "b"
    assert prepare_directory("--state-dir", state) == state
    assert state.stat().st_mode & 0o777 == 0o700
    assert os.listdir(state) == []


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["serve", *FREE, "--tap-upstream", "127.0.0.1:9"], "--state-dir"),
        (["serve", *FREE, "--tap-upstream", "127.0.0.1:9", "--capture-dir"], "--capture-dir"),
        (["node", "--listen", "127.0.0.1:0"], "--data-dir"),
        (["move", "--from-tap", "127.0.0.1:9", "--to-upr", "127.0.0.1:9", "--vbuckets", "1"],
         "--state-dir"),
    ],
)  # fmt: skip
def test_every_command_says_it_in_one_line_with_exit_status_1(
    tmp_path: Path, command: list[str], option: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    target = afile / "state"
    args = [*command, str(target)] if command[-1] == option else [*command, option, str(target)]
    done = subprocess.run([*GATEWAY, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert only_line(done.stderr) == (
        f"{command[0]}: {option} {target}: {afile} is a file, not a directory"
    )


def _can_bind_mount(path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-m", "mount", "--bind", "-o", "ro", str(path), str(path)]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


@AS_ROOT
@pytest.mark.parametrize("inside", [False, True])
def test_a_read_only_mount_is_named_as_such(tmp_path: Path, inside: bool) -> None:
    """Root passes ``os.access`` on a read-only mount: the check writes a file."""
    if not _can_bind_mount(tmp_path):
        pytest.skip("no private mount namespace here")
    state = tmp_path / "state" if inside else tmp_path
    node = [*GATEWAY, "node", "--listen", "127.0.0.1:0", "--data-dir", str(state)]
    # The mount lives in the child's own namespace and goes with it.
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, str(tmp_path), *node],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    action = "cannot create it" if inside else "cannot write in it"
    assert only_line(done.stderr) == (
        f"node: --data-dir {state}: {action}: read-only file system (EROFS)"
    )


def test_files_left_open_to_others_are_made_private_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restore or a copy that lost the modes: the next start makes them private."""
    state = tmp_path / "state"
    (state / "vb-0000").mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    (state / "vb-0000").chmod(0o755)
    (state / "vb-0000" / "00000001.seg").write_text("")
    (state / "vb-0000" / "00000001.seg").chmod(0o644)
    (state / "lock").write_text("")
    (state / "lock").chmod(0o600)
    with caplog.at_level(logging.WARNING):
        prepare_directory("--state-dir", state)
    modes = {p.relative_to(state).as_posix(): p.stat().st_mode & 0o777 for p in state.rglob("*")}
    assert modes == {"lock": 0o600, "vb-0000": 0o700, "vb-0000/00000001.seg": 0o600}
    assert [r.getMessage() for r in caplog.records] == [
        f"--state-dir {state}: vb-0000 (mode 755) and 1 more were open to other users: "
        "made private (files 0600, directories 0700)"
    ]


@AS_ROOT
def test_files_of_another_user_inside_are_refused_naming_one(tmp_path: Path) -> None:
    """A run as another user (``sudo serve`` on the service's directory) left files the
    gateway could not rewrite: said at start, not as a failed write mid-serve."""
    state = tmp_path / "state"
    (state / "vb-0001").mkdir(parents=True, mode=0o700)
    for name in ("a.seg", "b.seg"):
        (state / "vb-0001" / name).write_text("")
        os.chown(state / "vb-0001" / name, 65534, 65534)
    reason = refusal(state)
    assert reason.startswith("vb-0001/a.seg and 1 more are owned by ") or reason.startswith(
        "vb-0001/b.seg and 1 more are owned by "
    )
    assert "(uid 65534), not by " in reason
    assert reason.endswith(f"(this process): run as their owner, or chown -R root {state}")
