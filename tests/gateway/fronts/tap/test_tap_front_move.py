"""Push mode: vbuckets moved from a UPR node into a TAP-receiving node."""

from __future__ import annotations

import pytest
import trio

from adapters.mcbp.constants import VBucketState
from gateway.fronts.tap.move import MoveFailed, move_upr_to_tap
from gateway.fronts.tap.session import SessionConfig
from gateway.node.store import Store
from tests.support.tap_client import start_node
from tests.support.tapfront import filled_store, node_state

VBUCKETS = 4


@pytest.mark.parametrize("takeover", [True, False])
async def test_move_into_a_tap_node(nursery: trio.Nursery, takeover: bool) -> None:
    source = filled_store()
    destination = Store(VBUCKETS, initial_state=VBucketState.DEAD)  # left by an earlier move
    _, source_port = await start_node(nursery, source)
    _, destination_port = await start_node(nursery, destination)
    with trio.fail_after(20):
        stats = await move_upr_to_tap(
            ("127.0.0.1", source_port),
            ("127.0.0.1", destination_port),
            [1, 2],
            takeover=takeover,
            config=SessionConfig(upstream=("127.0.0.1", source_port), backoff=0.05),
        )
    assert node_state(destination, (1, 2)) == node_state(source, (1, 2))
    assert not node_state(destination, (0, 3))
    assert [destination.state(vb) for vb in (0, 3)] == [VBucketState.DEAD] * 2
    if takeover:
        assert [source.state(vb) for vb in (1, 2)] == [VBucketState.DEAD] * 2
        assert [destination.state(vb) for vb in (1, 2)] == [VBucketState.ACTIVE] * 2
        assert stats.takeovers_completed_total["tap_front"] == 2
    else:
        assert [source.state(vb) for vb in (1, 2)] == [VBucketState.ACTIVE] * 2
        assert [destination.state(vb) for vb in (1, 2)] == [VBucketState.REPLICA] * 2


async def test_moving_a_vbucket_the_source_does_not_own_fails_clearly(
    nursery: trio.Nursery,
) -> None:
    source = filled_store()
    source.set_state(3, VBucketState.REPLICA, now=0.0)
    _, source_port = await start_node(nursery, source)
    _, destination_port = await start_node(nursery, vbuckets=VBUCKETS)
    with trio.fail_after(10), pytest.raises(MoveFailed, match="vbucket 3 is not active"):
        await move_upr_to_tap(
            ("127.0.0.1", source_port), ("127.0.0.1", destination_port), [3], takeover=True
        )


async def test_an_active_destination_vbucket_is_never_overwritten(nursery: trio.Nursery) -> None:
    source = filled_store()
    destination = filled_store()
    _, source_port = await start_node(nursery, source)
    _, destination_port = await start_node(nursery, destination)
    before = node_state(destination, (2,))
    with trio.fail_after(10), pytest.raises(MoveFailed, match="vbucket 2 is active on the dest"):
        await move_upr_to_tap(
            ("127.0.0.1", source_port), ("127.0.0.1", destination_port), [2], takeover=True
        )
    assert destination.state(2) is VBucketState.ACTIVE and node_state(destination, (2,)) == before
    assert source.state(2) is VBucketState.ACTIVE
