"""STAT on the TAP front's command connection when the answer has to come from
the UPR upstream: an unreachable upstream is named with the reason (status
0x86, temporary failure: the client may retry), the upstream's own refusal is
passed on, and only a group the front does not serve is "unknown"
(gateway/fronts/tap/server.py ``TapFront.stat_pairs``)."""

from __future__ import annotations

import socket

import trio

from adapters.mcbp import Opcode, Status
from gateway.io.connection import PacketConnection, RequestFailed
from tests.support.fronts import tap_front_over_node
from tests.support.tapfront import filled_store, start_front


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def stat_failure(port: int, group: str) -> RequestFailed:
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        try:
            await client.stats(group)
        except RequestFailed as failed:
            # The connection stays usable after a refused STAT.
            assert (await client.request(Opcode.NOOP)).vbucket_or_status == Status.SUCCESS
            return failed
    raise AssertionError(f"STAT {group} succeeded")


async def test_stat_with_the_upstream_unreachable_names_it(nursery: trio.Nursery) -> None:
    dead = closed_port()
    _, port = await start_front(nursery, dead)
    for group in ("vbucket-seqno", "vbucket"):
        failed = await stat_failure(port, group)
        assert failed.status == Status.TEMPORARY_FAILURE
        text = failed.text.decode()
        assert text == (
            f"UPR upstream 127.0.0.1:{dead} is unreachable: "
            "connection refused (nothing listens there)"
        )
        assert "unknown stat group" not in text
    # The front's own group does not need the upstream.
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        assert (await client.stats("tap"))["ep_tap_count"] == "0"


async def test_tap_connect_with_the_upstream_unreachable_names_it(nursery: trio.Nursery) -> None:
    from tests.support.tap_client import TapClient, connect_event

    dead = closed_port()
    _, port = await start_front(nursery, dead)
    client = await TapClient.open(port, connect_event(b"ops"))
    with trio.fail_after(10):
        frame = await client.next_frame()
    assert frame is not None and frame.vbucket_or_status == Status.TEMPORARY_FAILURE
    assert frame.value.decode().startswith(
        f"UPR upstream 127.0.0.1:{dead} is unreachable: connection refused (nothing listens there)"
    )
    await client.aclose()


async def test_unknown_group_says_which_groups_are_served(nursery: trio.Nursery) -> None:
    rig = await tap_front_over_node(nursery, filled_store())
    failed = await stat_failure(rig.port, "hash")
    assert failed.status == Status.KEY_NOT_FOUND
    assert failed.text == (
        b"unknown stat group 'hash' (known: dcp, tap, tap-vbtakeover, upr, vbucket, "
        b"vbucket-seqno, vbucket-takeover)"
    )


async def test_upstream_refusal_is_passed_on(nursery: trio.Nursery) -> None:
    rig = await tap_front_over_node(nursery, filled_store())
    async with await PacketConnection.connect("127.0.0.1", rig.upstream_port) as direct:
        try:
            await direct.stats("vbucket-seqno 60000")
            raise AssertionError("the node answered a vbucket it does not have")
        except RequestFailed as node_says:
            expected = node_says
    failed = await stat_failure(rig.port, "vbucket-seqno 60000")
    assert failed.status == expected.status
    assert failed.text.decode().startswith(f"UPR upstream 127.0.0.1:{rig.upstream_port}: ")
    async with await PacketConnection.connect("127.0.0.1", rig.port) as client:
        seqnos = await client.stats("vbucket-seqno")
    assert "vb_0:high_seqno" in seqnos
