"""The reference node (``node --data-dir``) SIGKILLed while it takes writes and serves UPR.

See ``tests.support.node_crash``: what survives a kill is a prefix of the
acknowledged writes (all of them with ``--fsync always``), and a 3.0 consumer
that saw more than survived is rolled back (ep-engine 3.0
src/failover-table.cc ``needsRollback``). The seed is printed; ``CRASH_SEED``
replays one.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.support.node_crash import node_crash_run


def seed() -> int:
    chosen = int(os.environ.get("CRASH_SEED", random.randrange(2**32)))
    print(f"crash seed {chosen} (replay: CRASH_SEED={chosen})")
    return chosen


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_a_few_kills_keep_a_prefix_of_the_acked_writes(tmp_path: Path, fsync: str) -> None:
    chosen = seed()
    try:
        summary = await node_crash_run(tmp_path, chosen, kills=3, fsync=fsync)
    except BaseException as exc:
        exc.add_note(f"crash seed {chosen}")
        raise
    print(summary)
    assert summary.kills == 3 and summary.acked


@pytest.mark.slow
@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
async def test_many_kills_keep_a_prefix_of_the_acked_writes(tmp_path: Path, fsync: str) -> None:
    chosen = seed()
    try:
        summary = await node_crash_run(tmp_path, chosen, kills=10, fsync=fsync)
    except BaseException as exc:
        exc.add_note(f"crash seed {chosen}")
        raise
    print(summary)
    assert summary.kills == 10 and summary.acked
