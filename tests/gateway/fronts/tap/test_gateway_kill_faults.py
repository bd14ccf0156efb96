"""The TAP front's process SIGKILLed mid-stream and started again on its state
directory, its upstream a reference node that stays up.

- A registered client (REGISTERED_CLIENT, support-ack) that reconnects under
  its name resumes from what it acked: everything it had not acked comes
  again, nothing is skipped. ep-engine 2.5.1 kept a named TAP connection's
  ack log and put it back in the queue when the name reconnected
  (src/tapconnection.cc ``TapProducer::rollback``, src/tapconnmap.cc
  ``TapConnMap::newProducer``); the front keeps the acked positions in
  ``tap-front-state.msgpack``, which may be older than the kill, never newer
  than the acks.
- A client that resumes with the CHECKPOINT flag and the id of the last
  checkpoint it closed (2.5.1 src/checkpoint.cc: a checkpoint id names one
  range of one vbucket's history, ids only grow) must get everything after
  that checkpoint: an id handed out after the last save must not name
  another range after the restart.
"""

from __future__ import annotations

import signal
from pathlib import Path

import msgpack
import trio

from adapters.tap import ConnectFlags, TapCheckpointEnd, TapEvent
from gateway.fronts.tap.registry import STATE_FILE
from gateway.node.store import Store
from tests.gateway.fronts.tap.faults import (
    VBUCKETS,
    HoldingClient,
    mutation_keys,
    resets,
    versions_in_order,
    write_keys,
)
from tests.support.children import start_listening
from tests.support.tap_client import TapClient, connect_event, start_node, until
from tests.support.tapfront import Replica, catch_up, node_state

F = ConnectFlags
GATEWAY = """
import sys, trio
from pathlib import Path
from gateway.fronts.tap.server import TapFront, TapFrontConfig

async def main():
    config = TapFrontConfig(
        ("127.0.0.1", 0),
        ("127.0.0.1", int(sys.argv[1])),
        state_dir=Path(sys.argv[2]),
        save_interval=float(sys.argv[3]),
        max_unacked=100,
        ack_interval=20,
        noop_interval=0.5,
    )
    async with trio.open_nursery() as nursery:
        print(await nursery.start(TapFront(config).serve), flush=True)

trio.run(main)
"""


async def start_gateway(
    node_port: int, state_dir: Path, save_interval: float
) -> tuple[trio.Process, int]:
    return await start_listening(
        GATEWAY, node_port, state_dir, save_interval, what="the gateway process"
    )


async def kill(proc: trio.Process) -> None:
    proc.send_signal(signal.SIGKILL)
    await proc.wait()


def saved_positions(state_dir: Path, name: str) -> dict[int, object]:
    try:
        data = msgpack.unpackb((state_dir / STATE_FILE).read_bytes(), strict_map_key=False)
    except FileNotFoundError:
        return {}
    return dict(data["clients"].get(name, {}))


async def test_killed_gateway_a_registered_client_resumes_from_its_acks(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS)
    keys = write_keys(store, b"reg", 3000, size=1000)
    _, node_port = await start_node(nursery, store)
    state_dir = tmp_path / "gateway"
    flags = F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT | F.REGISTERED_CLIENT
    gateway, port = await start_gateway(node_port, state_dir, 0.05)
    try:
        with trio.fail_after(60):
            tap = await TapClient.open(port, connect_event(b"reg", flags, backfill_date=0))
            client = HoldingClient(tap, hold_at=1500)
            nursery.start_soon(client.run)
            await client.wait_for(lambda: client.holding and client.held)
            # What it acked is saved (the file is never ahead of the acks).
            await until(lambda: len(saved_positions(state_dir, "reg")) >= 2)
            live = write_keys(store, b"live", 40)
            await kill(gateway)
            await client.wait_for(lambda: client.closed)
            first = client.events
            unacked = set(mutation_keys(first[client.acked_upto :]))
            assert unacked
            gateway, port = await start_gateway(node_port, state_dir, 0.05)
            second = await TapClient.open(port, connect_event(b"reg", flags, backfill_date=0))
            replica = Replica()
            replica.apply(first)
            resumed = await catch_up(second, replica, store)
            await second.aclose()
    finally:
        await kill(gateway)
    # Every item it had not acked comes again; nothing is missing; order per key.
    assert unacked <= set(mutation_keys(resumed))
    assert set(mutation_keys(first + resumed)) == set(keys + live)
    versions_in_order(first + resumed)
    assert replica.items == node_state(store, range(VBUCKETS))
    # The vbuckets with a saved position resumed rather than backfilled again.
    assert len(set(resets(resumed))) < VBUCKETS


async def test_killed_gateway_never_reuses_a_checkpoint_id_a_client_holds(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS)
    _, node_port = await start_node(nursery, store)
    state_dir = tmp_path / "gateway"
    flags = F.SUPPORT_ACK | F.CHECKPOINT
    # No periodic save before the kill: the ids handed out are newer than the file.
    gateway, port = await start_gateway(node_port, state_dir, 3600)
    try:
        with trio.fail_after(60):
            tap = await TapClient.open(port, connect_event(b"holder", flags))
            holder = HoldingClient(tap)
            nursery.start_soon(holder.run)
            await _wait_streaming(holder)
            write_keys(store, b"seen", 40)
            await holder.wait_for(lambda: holder.mutations >= 40 and _closed(holder.events))
            last_closed = _closed(holder.events)
            await kill(gateway)
            await holder.wait_for(lambda: holder.closed)
            missed = write_keys(store, b"missed", 40)  # while the gateway is down

            gateway, port = await start_gateway(node_port, state_dir, 3600)
            # Another client takes checkpoints from the restarted gateway meanwhile.
            tap = await TapClient.open(port, connect_event(b"other", flags))
            other = HoldingClient(tap)
            nursery.start_soon(other.run)
            await _wait_streaming(other)
            for round_ in range(1, 5):
                write_keys(store, b"later-%d" % round_, 40)
                await other.wait_for(lambda n=40 * round_: other.mutations >= n)
            # ... until it closed ids as high as the holder's (the same ids, unless
            # the restart moved past them).
            await other.wait_for(lambda: _reached(_closed(other.events), last_closed))
            # The holder comes back with the checkpoints it closed.
            back = await TapClient.open(
                port,
                connect_event(b"holder", flags, checkpoints=tuple(sorted(last_closed.items()))),
            )
            returned = HoldingClient(back)
            nursery.start_soon(returned.run)
            await _wait_streaming(returned)
            final = write_keys(store, b"final", VBUCKETS)
            await returned.wait_for(lambda: set(final) <= set(mutation_keys(returned.events)))
            events = returned.events
            await back.aclose()
    finally:
        await kill(gateway)
    assert set(missed) <= set(mutation_keys(events)), "resumed past items it never received"
    versions_in_order(holder.events + events)


async def _wait_streaming(client: HoldingClient) -> None:
    """Until the stream's opening messages arrived (its streams are requested)."""
    await client.wait_for(lambda: len(client.events) >= 2)


def _closed(events: list[TapEvent]) -> dict[int, int]:
    """The last checkpoint id each vbucket closed."""
    return {e.vbucket: e.checkpoint_id for e in events if isinstance(e, TapCheckpointEnd)}


def _reached(closed: dict[int, int], ids: dict[int, int]) -> bool:
    return all(closed.get(vb, 0) >= cp for vb, cp in ids.items())
