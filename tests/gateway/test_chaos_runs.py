"""Seeded randomized fault runs over real processes (``tests/support/chaos.py``).

A node process feeds ``serve`` (both fronts) through relays that cut, stall and
truncate; ``serve`` and the node are SIGKILLed, SIGSTOPped, restarted, run with
a file-size limit and have a closed segment damaged while down; consumers stop
reading. The checks follow ep-engine v3.0.0 src/upr-consumer.cc and
src/failover-table.cc (resume and rollback) and 2.5.1 src/tapconnmap.cc
(registered TAP clients resume from their acks); see the harness's docstring.
``CHAOS_SEED`` replays one printed seed.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.support.chaos import ChaosRun


async def run(tmp_path: Path, seed: int, faults: int, **kw: Any) -> None:
    print(f"chaos seed {seed} (replay: CHAOS_SEED={seed})")
    try:
        summary = await ChaosRun(tmp_path, seed).run(faults, **kw)
    except BaseException as exc:
        exc.add_note(f"chaos seed {seed} (replay: CHAOS_SEED={seed})")
        raise
    print(summary)
    assert summary.upr_items and summary.keys


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_few_faults_lose_nothing(tmp_path: Path, seed: int) -> None:
    await run(tmp_path, int(os.environ.get("CHAOS_SEED", seed)), 3, gap=(0.2, 0.8), max_ttl=1)


@pytest.mark.slow
async def test_many_faults_lose_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(2**32)))
    await run(tmp_path, seed, faults=int(os.environ.get("CHAOS_FAULTS", 40)))
