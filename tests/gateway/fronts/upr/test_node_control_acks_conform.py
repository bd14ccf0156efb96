"""The UPR front's ingest keeps up with a node that waits for its control acks.

ep-engine 2.5.1 sends nothing but OPAQUE and VBUCKET_SET while an OPAQUE is
unacked (src/ep_engine.cc ``doWalkTapQueue``, ``waitForOpaqueMsgAck``) and no
item while a checkpoint message is (src/tapconnection.cc ``getNextItem``,
``waitForCheckpointMsgAck``): an ingest that held those acks for more input
would stall it. The reference node does the same with
``tap_wait_control_acks``; under concurrent writes and short checkpoints
(one control round trip each) the front still ends with the node's state, in
each fsync mode (the group commit must ack without waiting for more reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.gateway.fronts.upr.support import (
    caught_up,
    filled_store,
    until,
    write_load,
)
from tests.support.fronts import upr_front_over_node


@pytest.mark.parametrize("fsync", ["batch", "always", "never"])
async def test_the_ingest_acks_each_control_message_without_more_input(
    nursery: trio.Nursery, tmp_path: Path, fsync: str
) -> None:
    store = filled_store(20)
    rig = await upr_front_over_node(
        nursery,
        tmp_path,
        store,
        node={"checkpoint_interval": 0.02, "tap_wait_control_acks": True},
        fsync=fsync,
    )
    with trio.fail_after(20):
        await until(lambda: caught_up(rig.front, store))
        stream = rig.node.tap.get(rig.front.config.tap_name)
        assert stream is not None and stream.wait_control_acks
        rounds = 0
        while stream.checkpoint_ends < 3:  # writes across several checkpoints
            rounds += 1
            await write_load(store, 50, seed=rounds)
            await until(lambda: caught_up(rig.front, store))
