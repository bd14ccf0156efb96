"""The node's and the UPR front's producer connections answer STAT dcp alike.

One ``connection_stats`` (gateway/io/upr_producer.py) serves both, with
ep-engine 3.0's per-connection names (src/upr-producer.cc ``addStats``):
the same lines, in the same order, for a consumer with one stream on each.
"""

from __future__ import annotations

from pathlib import Path

import trio

from tests.gateway.fronts.upr.support import (
    MAX_SEQNO,
    filled_store,
    open_producer,
    until,
)
from tests.support.fronts import upr_front_over_node

CONNECTION_LINES = [
    "type",
    "items_sent",
    "items_remaining",
    "total_bytes_sent",
    "unacked_bytes",
    "total_acked_bytes",
    "max_buffer_bytes",
    "flow_control",
    "paused",
    "noop_enabled",
    "noop_interval",
    "enable_expiry_opcode",
    "num_streams",
]


def connection_lines(pairs: list[tuple[str, str]], prefix: str) -> dict[str, str]:
    """The connection's own lines (not its streams'), names without ``prefix``."""
    assert all(name.startswith(prefix) for name, _ in pairs)
    return {
        name[len(prefix) :]: value
        for name, value in pairs
        if not name[len(prefix) :].startswith("stream_")
    }


async def test_node_and_front_report_the_same_connection_lines(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    consumers = [await open_producer(each, b"replica") for each in (rig.node_port, rig.port)]
    for consumer in consumers:
        await consumer.stream_request(3, 0, MAX_SEQNO, opaque=1)

    def streaming() -> bool:
        theirs = rig.node.upr.get("replica")
        ours = rig.front.connections.get("replica")
        return all(c is not None and 3 in c.streams for c in (theirs, ours))

    with trio.fail_after(10):
        await until(streaming)
    theirs = connection_lines(rig.node.upr.get("replica").connection_stats(), "")
    ours = connection_lines(rig.front.connections["replica"].connection_stats(), "replica:")
    assert list(theirs) == list(ours) == CONNECTION_LINES
    for name in ("type", "flow_control", "noop_enabled", "enable_expiry_opcode", "num_streams"):
        assert theirs[name] == ours[name], name
    for consumer in consumers:
        await consumer.aclose()
