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
import struct
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters.mcbp.constants import Opcode
from adapters.tap import ConnectFlags
from gateway.io.connection import PacketConnection
from tests.support.chaos import ChaosRun
from tests.support.chaos_net import (
    NODE_LISTENING,
    TAP_LISTENING,
    UPR_LISTENING,
    Proc,
    fsize_limit,
    log_problems,
    node_command,
    serve_command,
)
from tests.support.chaos_peers import ChaosConsumer, ChaosTapClient, Port, node_state
from tests.support.waiting import until


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


async def test_serve_under_a_file_size_limit_keeps_serving(tmp_path: Path) -> None:
    """Found by the chaos runs: ``serve`` restarted under RLIMIT_FSIZE stopped at once
    (exit 1, ``--tap-listen ...: File too large``: the TAP front's state file could not be
    marked in use; or ``--upr-listen ...`` for an unclean log's meta), and later a
    compaction's EFBIG stopped it too. A disk that refuses writes must cost the writes,
    not the process: both fronts keep serving what they hold, each refusal one error
    line, and SIGTERM still exits 0. Only a log that cannot record its new history
    stops the start, with one line naming the state directory."""
    async with trio.open_nursery() as nursery:
        node = await Proc.start(nursery, "node", node_command(tmp_path / "node", 4, "batch"),
                                [NODE_LISTENING])  # fmt: skip
        await node.wait_listening(60)
        port = node.ports[0]
        async with await PacketConnection.connect("127.0.0.1", port) as conn:
            for i in range(200):  # 300 KB over 4 vbuckets: segments of 16 KiB roll
                await conn.request(Opcode.SET, key=b"key-%d" % i, value=b"v" * 1500,
                                   extras=struct.pack(">II", 0, 0), vbucket=i % 4)  # fmt: skip
        want = await node_state(port, 4, b"audit")
        state = tmp_path / "state"
        command = serve_command(state, port, port, "batch", compact_interval=0.2)
        serve = await Proc.start(nursery, "serve", command, [UPR_LISTENING, TAP_LISTENING])
        await serve.wait_listening(60)
        consumer = ChaosConsumer(4, b"limits")
        reading = trio.CancelScope()

        async def follow(port: int) -> None:
            with reading:
                await consumer.run(Port(port))

        nursery.start_soon(follow, serve.ports[0])
        with trio.fail_after(60):
            await until(lambda: consumer.live() == want)
        reading.cancel()
        await serve.kill()  # unclean: the next start must mark its files
        limited = await Proc.start(nursery, "serve", command, [UPR_LISTENING, TAP_LISTENING],
                                   preexec=fsize_limit(64))  # fmt: skip
        # Too small for even a meta: the unclean logs cannot record their new history,
        # so nothing may be served from them; the start stops, naming the state dir.
        await limited.exited.wait()
        assert limited.proc.returncode == 1
        assert limited.lines[-1] == (
            f"serve: --state-dir {state}: cannot open the UPR front's log: writing vb-0000 "
            "failed: File too large"
        ), limited.log_tail()
        limited = await Proc.start(nursery, "serve", command, [UPR_LISTENING, TAP_LISTENING],
                                   preexec=fsize_limit(4096))  # fmt: skip
        await limited.wait_listening(60)
        with trio.fail_after(60):
            await until(lambda: any("compaction skipped" in line for line in limited.lines))
        assert limited.alive
        again = ChaosConsumer(4, b"limits-again")
        tap = ChaosTapClient(Port(limited.ports[1]), b"limits-tap", ConnectFlags.BACKFILL,
                             registered=False)  # fmt: skip
        async with trio.open_nursery() as peers:
            peers.start_soon(again.run, Port(limited.ports[0]))
            peers.start_soon(tap.run)
            with trio.fail_after(60):
                await until(lambda: again.live() == want and tap.live() == want)
            peers.cancel_scope.cancel()
        assert await limited.stop() == 0, limited.log_tail()
        assert await node.stop() == 0
        problems = [line for p in (serve, limited, node) for line in log_problems(p)]
        assert not problems
