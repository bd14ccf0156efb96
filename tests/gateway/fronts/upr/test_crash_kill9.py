"""``serve``'s UPR front SIGKILLed at random moments: nothing acknowledged is lost.

The harness (``tests.support.crash_harness``) runs the real ``serve`` process
over a reference node in this process, kills it during start-up, backfill,
live ingest, compaction and segment rolls, restarts it on the same state
directory and checks, after each kill, what the node saw acked against the
log, and what a 3.0 consumer that follows every restart (ep-engine v3.0.0
src/upr-consumer.cc ``doRollback``, src/failover-table.cc ``needsRollback``) holds against
what the front serves it. The seed is printed; ``CRASH_SEED`` replays one.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.support.crash_harness import crash_run


def seed() -> int:
    chosen = int(os.environ.get("CRASH_SEED", random.randrange(2**32)))
    print(f"crash seed {chosen} (replay: CRASH_SEED={chosen})")
    return chosen


async def test_a_few_kills_lose_nothing_acked(tmp_path: Path) -> None:
    chosen = seed()
    try:
        summary = await crash_run(tmp_path, chosen, kills=4)
    except BaseException as exc:
        exc.add_note(f"crash seed {chosen}")
        raise
    print(summary)
    assert summary.kills == 4 and summary.items_received


@pytest.mark.slow
async def test_many_kills_lose_nothing_acked(tmp_path: Path) -> None:
    chosen = seed()
    try:
        summary = await crash_run(tmp_path, chosen, kills=35, kill_after=(0.2, 3.0))
    except BaseException as exc:
        exc.add_note(f"crash seed {chosen}")
        raise
    print(summary)
    assert summary.kills == 35 and summary.acked_checked
