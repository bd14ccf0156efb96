"""SASL on both sides of the TAP front, and the command connection before CONNECT."""

from __future__ import annotations

import trio

from adapters.mcbp import Opcode, Status
from adapters.tap import ConnectFlags, TapMutation, encode
from gateway.io.connection import PacketConnection, RequestFailed
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import TapClient, connect_event, start_node
from tests.support.tapfront import filled_store, start_front

F = ConnectFlags


async def test_clients_must_authenticate_and_the_upstream_login_is_used(
    nursery: trio.Nursery,
) -> None:
    store = filled_store()
    _, node_port = await start_node(nursery, store, users={"gateway": "s3cret"})
    _, port = await start_front(
        nursery,
        node_port,
        users={"old-client": "pw"},
        upstream_user="gateway",
        upstream_password="s3cret",
    )
    with trio.fail_after(20):
        async with await PacketConnection.connect("127.0.0.1", port) as anonymous:
            mechs = await anonymous.request(Opcode.SASL_LIST_MECHS)
            assert mechs.value == b"CRAM-MD5 PLAIN"  # cbsasl src/cbsasl.c cbsasl_list_mechs
            refused = await anonymous.request(Opcode.STAT, check=False)
            assert refused.vbucket_or_status == Status.AUTH_ERROR
            try:
                await anonymous.sasl_plain("old-client", "wrong")
            except RequestFailed as exc:
                assert exc.status == Status.AUTH_ERROR
            else:
                raise AssertionError("a wrong password was accepted")
        client = await PacketConnection.connect("127.0.0.1", port)
        await client.sasl_plain("old-client", "pw")
        tap_client = TapClient(client.stream)
        await tap_client.send(
            encode(connect_event(b"authed", F.DUMP | F.BACKFILL, backfill_date=0))
        )
        events = await tap_client.collect()
        assert sum(isinstance(e, TapMutation) for e in events) == sum(
            not item.deleted for vb in range(4) for item in store.items_since(vb, 0)
        )


async def test_wrong_upstream_credentials_refuse_the_connect_clearly(
    nursery: trio.Nursery,
) -> None:
    rig = await tap_front_over_node(
        nursery,
        filled_store(),
        node={"users": {"gateway": "s3cret"}},
        upstream_user="gateway",
        upstream_password="x",
    )
    with trio.fail_after(20):
        client = await rig.client(b"c", F.BACKFILL, backfill_date=0)
        answer = await client.next_event()
        assert answer is not None and getattr(answer, "status", None) == Status.TEMPORARY_FAILURE
        assert b"upstream" in answer.text  # type: ignore[union-attr]
        assert await client.next_event() is None
