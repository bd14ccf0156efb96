"""The reference node's memcached side: commands, STAT groups, SASL, load generator."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from functools import partial

import pytest
import trio

from adapters.mcbp import Magic, Opcode, Status, encode_frame
from adapters.mcbp.constants import VBucketState
from adapters.mcbp.vbucket import vbucket_of
from gateway.io.connection import PacketConnection, RequestFailed
from gateway.io.listen import bound_port
from gateway.node.commands import NODE_FAILOVER
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store
from gateway.tools.load import run_load
from tests.support.waiting import until

VBUCKETS = 8


async def start_node(nursery: trio.Nursery, **config: object) -> tuple[Node, int]:
    node = Node(Store(VBUCKETS), NodeConfig(vbuckets=VBUCKETS, **config))  # type: ignore[arg-type]
    listeners = await nursery.start(partial(node.serve, "127.0.0.1", 0))
    return node, bound_port(listeners)


@pytest.fixture
async def node_port(nursery: trio.Nursery) -> AsyncIterator[tuple[Node, int]]:
    yield await start_node(nursery)


def store_extras(flags: int = 0, expiration: int = 0) -> bytes:
    return struct.pack(">II", flags, expiration)


async def test_set_get_delete_with_cas(node_port: tuple[Node, int]) -> None:
    node, port = node_port
    key = b"alpha"
    vb = vbucket_of(key, VBUCKETS)
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        stored = await client.request(
            Opcode.SET, key=key, value=b"one", vbucket=vb, extras=store_extras(flags=0xCAFE)
        )
        got = await client.request(Opcode.GET, key=key, vbucket=vb)
        assert got.value == b"one" and got.cas == stored.cas
        assert struct.unpack(">I", got.extras)[0] == 0xCAFE
        with pytest.raises(RequestFailed) as info:
            await client.request(Opcode.ADD, key=key, value=b"x", vbucket=vb, extras=store_extras())
        assert info.value.status == Status.KEY_EXISTS
        with pytest.raises(RequestFailed) as info:
            await client.request(Opcode.DELETE, key=key, vbucket=vb, cas=stored.cas + 1)
        assert info.value.status == Status.KEY_EXISTS
        await client.request(Opcode.DELETE, key=key, vbucket=vb, cas=stored.cas)
        with pytest.raises(RequestFailed) as info:
            await client.request(Opcode.GET, key=key, vbucket=vb)
        assert info.value.status == Status.KEY_NOT_FOUND
        with pytest.raises(RequestFailed) as info:
            await client.request(
                Opcode.REPLACE, key=key, value=b"x", vbucket=vb, extras=store_extras()
            )
        assert info.value.status == Status.KEY_NOT_FOUND
    item = node.store.lookup(vb, key)
    assert item is not None and item.deleted and item.rev_seqno == 2


async def test_wrong_vbucket_state_and_set_vbucket(node_port: tuple[Node, int]) -> None:
    node, port = node_port
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        await client.request(
            Opcode.SET_VBUCKET, vbucket=3, extras=struct.pack(">I", VBucketState.REPLICA)
        )
        assert node.store.state(3) is VBucketState.REPLICA
        with pytest.raises(RequestFailed) as info:
            await client.request(Opcode.SET, key=b"k", value=b"v", vbucket=3, extras=store_extras())
        assert info.value.status == Status.NOT_MY_VBUCKET
        state = await client.request(Opcode.GET_VBUCKET, vbucket=3)
        assert struct.unpack(">I", state.value)[0] == VBucketState.REPLICA
        stats = await client.stats("vbucket")
        assert stats["vb_3"] == "replica" and stats["vb_0"] == "active"


async def test_unknown_and_malformed_commands_keep_the_connection(
    node_port: tuple[Node, int],
) -> None:
    _, port = node_port
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        unknown = await client.request(0xE7, check=False)
        assert unknown.vbucket_or_status == Status.UNKNOWN_COMMAND
        assert b"0xe7" in unknown.value
        malformed = await client.request(Opcode.SET, key=b"k", extras=b"\x00" * 3, check=False)
        assert malformed.vbucket_or_status == Status.INVALID_ARGUMENTS
        assert b"extras must be 8 bytes" in malformed.value
        assert (await client.request(Opcode.NOOP)).vbucket_or_status == Status.SUCCESS
        version = await client.request(Opcode.VERSION)
        assert version.value.startswith(b"3.0")


async def test_stat_groups(node_port: tuple[Node, int]) -> None:
    node, port = node_port
    node.store.populate_sample(50)
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        general = await client.stats()
        assert general["curr_items"] == "50" and general["ep_num_vbuckets"] == str(VBUCKETS)
        seqnos = await client.stats("vbucket-seqno")
        total = sum(int(seqnos[f"vb_{vb}:high_seqno"]) for vb in range(VBUCKETS))
        assert total == 50
        assert seqnos["vb_0:uuid"] == str(node.store.uuid(0))
        one = await client.stats("vbucket-seqno 2")
        assert set(one) == {k for k in seqnos if k.startswith("vb_2:")}
        checkpoints = await client.stats("checkpoint")
        assert checkpoints["vb_0:open_checkpoint_id"] == "1"
        with pytest.raises(RequestFailed) as info:
            await client.stats("no-such-group")
        assert info.value.status == Status.KEY_NOT_FOUND


async def test_failover_command_adds_an_entry(node_port: tuple[Node, int]) -> None:
    node, port = node_port
    before = node.store.failover_log(1)
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        await client.request(NODE_FAILOVER, vbucket=1)
    after = node.store.failover_log(1)
    assert len(after) == len(before) + 1 and after[1:] == before


async def test_sasl_plain_is_required_when_users_are_configured(nursery: trio.Nursery) -> None:
    _, port = await start_node(nursery, users={"admin": "secret"})
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        refused = await client.request(Opcode.STAT, check=False)
        assert refused.vbucket_or_status == Status.AUTH_ERROR
        mechs = await client.request(Opcode.SASL_LIST_MECHS)
        assert mechs.value == b"CRAM-MD5 PLAIN"  # cbsasl src/cbsasl.c cbsasl_list_mechs
        with pytest.raises(RequestFailed) as info:
            await client.sasl_plain("admin", "wrong")
        assert info.value.status == Status.AUTH_ERROR
        await client.sasl_plain("admin", "secret")
        assert "curr_items" in await client.stats()


async def test_responses_on_a_command_connection_close_it_alone(
    node_port: tuple[Node, int],
) -> None:
    _, port = node_port
    rogue = await trio.open_tcp_stream("127.0.0.1", port)
    await rogue.send_all(encode_frame(Magic.RESPONSE, Opcode.GET))
    assert await rogue.receive_some(100) == b""
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        assert (await client.request(Opcode.NOOP)).vbucket_or_status == Status.SUCCESS
    await rogue.aclose()


async def test_load_generator_writes_deletes_and_ttls(node_port: tuple[Node, int]) -> None:
    node, port = node_port
    report = await run_load(
        "127.0.0.1", port, items=600, ttl_fraction=0.25, delete_fraction=0.2, seed=3
    )
    assert report.errors == {}
    assert report.sets == 600 and 0 < report.with_ttl < 600 and report.deletes > 0
    stats = node.store.stats()
    assert stats.items == 600 - report.deletes
    assert stats.tombstones == report.deletes
    expiring = [
        item for vb in range(VBUCKETS) for item in node.store.items_since(vb, 0) if item.expiration
    ]
    assert len(expiring) == report.with_ttl
    assert node.store.expire(max(i.expiration for i in expiring) + 1) != []
    assert node.store.stats().items == 600 - report.deletes - report.with_ttl


async def test_quit_closes_the_connection_and_curr_connections_counts_open_ones(
    node_port: tuple[Node, int],
) -> None:
    """memcached daemon/memcached.c: QUIT closes the connection without a reply."""
    node, port = node_port
    with trio.fail_after(10):
        async with await PacketConnection.connect("127.0.0.1", port) as watcher:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(encode_frame(Magic.REQUEST, Opcode.NOOP))
                assert await stream.receive_some(24)  # the NOOP's reply: served, counted
                assert (await watcher.stats(""))["curr_connections"] == "2"
                await stream.send_all(encode_frame(Magic.REQUEST, Opcode.QUIT))
                assert await stream.receive_some(1024) == b""
            await until(lambda: node.connections == 1)  # the QUIT one has gone
        await until(lambda: node.connections == 0)
