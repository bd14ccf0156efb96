"""The TAP front's state file when the disk refuses to write it (full, a file-size limit).

Found by the chaos runs (``tests/gateway/test_chaos_runs.py``): ``serve`` started
under RLIMIT_FSIZE stopped at once, exit 1, with ``--tap-listen 127.0.0.1:0: File
too large`` (the start-up save of the unclean mark, blamed on the listener), and
a periodic save failing would have stopped the whole process, its UPR front
too. Now a failed save leaves the file as it was, says so in one line and is
tried again at the next change. A start that cannot mark the file in use hands
out checkpoint ids above every id the file names: the file may still say clean,
and after a kill the next start would hand its counters out again, so an id must
never name two ranges (2.5.1 src/checkpoint.cc: checkpoint ids only grow).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.fronts.tap.registry import ID_GAP, STATE_FILE, Registry
from tests.gateway.fronts.tap.test_tap_front_state_set_aside import LOGGER, written_state


def block_writes(state_dir: Path) -> Path:
    """The file's temporary name taken by a directory: every save fails (EISDIR)."""
    blocker = state_dir / (STATE_FILE + ".tmp")
    blocker.mkdir()
    return blocker


def test_a_start_that_cannot_mark_the_file_hands_out_ids_above_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handed, data = written_state(tmp_path)
    blocker = block_writes(tmp_path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        registry = Registry.open(tmp_path)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot mark" in errors[0] and STATE_FILE in errors[0], errors
    assert "\n" not in errors[0]
    assert (tmp_path / STATE_FILE).read_bytes() == data  # as it was
    for vb, last in handed.items():
        assert next(registry.checkpoint_ids(vb)) > last + ID_GAP
    assert registry.positions("reg") is not None  # the clients' positions are kept
    assert registry.save() is False and registry.dirty  # still refused, no new line
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    blocker.rmdir()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert registry.save(clean=True) is True
    assert any("saved again" in r.getMessage() for r in caplog.records)
    again = Registry.open(tmp_path)
    for vb, last in handed.items():
        assert next(again.checkpoint_ids(vb)) > last + ID_GAP


def test_a_save_the_disk_refuses_keeps_the_state_for_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry.open(tmp_path)
    registry.register("reg")
    assert registry.save() is True
    before = (tmp_path / STATE_FILE).read_bytes()
    blocker = block_writes(tmp_path)
    registry.forget("reg")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert registry.save() is False
        assert registry.save(clean=True) is False  # on shutdown too: no exception
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot save" in errors[0], errors
    assert (tmp_path / STATE_FILE).read_bytes() == before
    blocker.rmdir()
    assert registry.save(clean=True) is True
    assert Registry.open(tmp_path).positions("reg") is None
