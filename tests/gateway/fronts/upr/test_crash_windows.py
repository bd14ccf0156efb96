"""What a SIGKILL leaves at a given point of the log's code, and what the next start makes of it.

Each test stops the code where a kill could land (an exception that nothing
catches, as a process that dies runs no more of it), leaves the files as
they are, and opens the state directory again as ``serve`` does
(``LogSet.open_existing`` and ``ensure``). A kill leaves the page cache
whole, so what is found is never damage: nothing is set aside, no vbucket is
fetched again and nothing a consumer could have been served is lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.fronts.upr.vblog import VbLog
from gateway.metrics.figures import GatewayStats
from tests.gateway.fronts.upr.test_vblog import fill


class Killed(BaseException):
    """The process died here."""


def log_set(root: Path) -> LogSet:
    logs = LogSet(root, LogOptions(), GatewayStats())
    logs.open_existing()
    return logs


def test_a_kill_before_a_new_vbucket_s_first_meta_leaves_a_new_vbucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new log creates its first (empty) segment, then writes its first meta
    (``VbLog._opened``): killed between the two, the directory holds an empty
    segment and no meta. Nothing was published (that needs the meta's
    reservation) and the manifest does not list the vbucket, so it opens as
    new, as a directory created just before a crash does; it used to be set
    aside as "meta missing" and fetched again whole from the TAP node."""
    log_set(tmp_path).abandon()  # a first start: the (empty) manifest is written

    def killed(self: VbLog, *, clean: bool) -> None:
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(VbLog, "_write_meta", killed)
        with pytest.raises(Killed):
            log_set(tmp_path).ensure(3)
    left = sorted(p.name for p in (tmp_path / "vb-0003").iterdir())
    assert left == ["00000000000000000001.seg"]  # empty, and no meta
    logs = log_set(tmp_path)
    vblog = logs.ensure(3)
    assert not vblog.problems and vblog.set_aside is None and not vblog.needs_refetch
    assert not (tmp_path / "set-aside").exists()
    assert not any(logs.stats.upr_log.logs_set_aside_total.values())
    logs.close()


def test_a_clean_stop_soon_after_a_kill_leaves_a_log_the_next_start_proves(
    tmp_path: Path,
) -> None:
    """Opened after a kill, a log starts a new failover entry at its proven end and
    its next seqno past the reservation (``log_open.adopt``); stopped cleanly before
    any new item, its clean mark used to record that next seqno's predecessor as the
    end, which no record on disk reaches: the next start took the log for one cut
    short, set it aside and fetched the vbucket again. The end recorded is where the
    records (or the newest history's start) end."""
    logs = log_set(tmp_path)
    fill(logs.ensure(0), rounds=3)
    proven = logs.logs[0].high_seqno
    logs.abandon()  # killed
    logs = log_set(tmp_path)
    vblog = logs.logs[0]
    assert not vblog.continued and vblog.failover.entries[0][1] == proven
    assert vblog.high_seqno > proven  # new items will follow the reservation
    uuid = vblog.failover.uuid
    logs.close()  # SIGTERM before the node sent anything for this vbucket
    logs = log_set(tmp_path)
    vblog = logs.logs[0]
    assert not vblog.problems and vblog.set_aside is None and not vblog.needs_refetch
    assert vblog.continued and vblog.failover.uuid == uuid
    assert [i.by_seqno for i in vblog.read(0, 2**64 - 1, 10**6)][-1] == proven
    fill(vblog, rounds=1)  # goes on above every seqno reserved before
    logs.close()
    logs = log_set(tmp_path)
    assert not logs.logs[0].problems and logs.logs[0].continued
    logs.close()
