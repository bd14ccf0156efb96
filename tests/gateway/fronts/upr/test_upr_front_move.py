"""Vbucket moves from a TAP node into a UPR node through the UPR front, with takeover."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from gateway.fronts.upr import UprFrontError, move_tap_to_upr
from gateway.node.items import ItemKind, VBucketState
from gateway.node.store import Store
from tests.gateway.fronts.upr.support import filled_store, start_node, write_load


def live(store: Store, vb: int) -> dict[bytes, tuple[bytes, int]]:
    return {
        it.key: (it.value, it.cas)
        for it in store.items_since(vb, 0)
        if it.kind is ItemKind.MUTATION
    }


async def test_takeover_move_into_a_upr_node(nursery: trio.Nursery, tmp_path: Path) -> None:
    source = filled_store(checkpoint_items=10)
    _, tap_port = await start_node(nursery, source, checkpoint_interval=0.05)
    destination = Store(4, initial_state=VBucketState.REPLICA)
    _, upr_port = await start_node(nursery, destination)
    load = trio.CancelScope()

    async def writes() -> None:
        with load:
            await write_load(source, 100_000, seed=5, pause_every=20)

    nursery.start_soon(writes)
    with trio.fail_after(30):
        await move_tap_to_upr(
            ("127.0.0.1", tap_port),
            ("127.0.0.1", upr_port),
            [1, 2],
            takeover=True,
            state_dir=tmp_path,
        )
    load.cancel()
    for vb in (1, 2):
        assert source.state(vb) is VBucketState.DEAD
        assert destination.state(vb) is VBucketState.ACTIVE
        assert live(destination, vb) == live(source, vb)
    assert destination.state(0) is VBucketState.REPLICA


async def test_replication_move_without_takeover(nursery: trio.Nursery, tmp_path: Path) -> None:
    source = filled_store()
    _, tap_port = await start_node(nursery, source)
    destination = Store(4, initial_state=VBucketState.REPLICA)
    _, upr_port = await start_node(nursery, destination)
    now = time.time()
    source.set(3, b"extra", b"x", now=now)
    with trio.fail_after(30):
        await move_tap_to_upr(
            ("127.0.0.1", tap_port), ("127.0.0.1", upr_port), [3], takeover=False,
            state_dir=tmp_path,
        )  # fmt: skip
    assert source.state(3) is VBucketState.ACTIVE
    assert destination.state(3) is VBucketState.REPLICA
    assert live(destination, 3) == live(source, 3)


async def test_move_into_an_active_vbucket_fails_clearly(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    source = filled_store(5)
    _, tap_port = await start_node(nursery, source)
    _, upr_port = await start_node(nursery, Store(4))  # everything active there
    with pytest.raises(UprFrontError, match="vbucket 1 is active on the destination"):
        with trio.fail_after(30):
            await move_tap_to_upr(
                ("127.0.0.1", tap_port), ("127.0.0.1", upr_port), [1], takeover=True,
                state_dir=tmp_path,
            )  # fmt: skip
