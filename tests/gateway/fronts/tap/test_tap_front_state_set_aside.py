"""The TAP front's state file when it cannot be read: set aside, never overwritten.

A file that is not msgpack, has another schema version, or is only half
valid is renamed aside whole; the front starts wholly fresh (no half-loaded
clients), registered clients backfill, and checkpoint ids start above any id
handed out before. That last point follows 2.5.1 src/checkpoint.cc: a
checkpoint id names one range of one vbucket's history and ids only grow, so
a client resuming from an id the gateway handed out before must never be
served the range after a new checkpoint of the same id.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from adapters.tap import ConnectFlags, TapCheckpointEnd, TapEvent
from gateway.fronts.tap.registry import (
    SET_ASIDE_MARK,
    STATE_FILE,
    Registry,
    UnreadableState,
    VbResume,
    decode_state,
)
from gateway.fronts.tap.server import TapFront, TapFrontConfig
from gateway.metrics import register_gateway_metrics
from gateway.metrics.figures import GatewayStats
from gateway.node.store import Store
from tests.gateway.fronts.tap.faults import (
    VBUCKETS,
    HoldingClient,
    mutation_keys,
    resets,
    versions_in_order,
    write_keys,
)
from tests.gateway.metrics.conftest import scrape, value
from tests.support.tap_client import TapClient, connect_event, start_node

F = ConnectFlags
LOGGER = "gateway.fronts.tap.registry"


def written_state(state_dir: Path) -> tuple[dict[int, int], bytes]:
    """A state file as a running front leaves it (a client, closed checkpoints,
    a clean stop): the ids it handed out per vbucket, and the file's bytes."""
    registry = Registry.open(state_dir)
    registry.register("reg")
    handed: dict[int, int] = {}
    for vb in range(VBUCKETS):
        ids = registry.checkpoint_ids(vb)
        for _ in range(3):
            handed[vb] = next(ids)
            registry.checkpoint_closed(vb, handed[vb], VbResume(7, 10 * vb, 0, 10 * vb))
        registry.advance("reg", vb, VbResume(7, 10 * vb, 0, 10 * vb, handed[vb]))
    registry.save(clean=True)
    return handed, (state_dir / STATE_FILE).read_bytes()


def rewrite(data: bytes, **fields: object) -> bytes:
    return msgpack.packb({**msgpack.unpackb(data, strict_map_key=False), **fields})


DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "garbage": lambda data: b"\xc1 not msgpack" + data[7:],
    "schema_version": lambda data: rewrite(data, version=2),
    "half_valid": lambda data: rewrite(data, next_ids=[1, 2, 3]),  # clients fine
}


def set_asides(state_dir: Path) -> list[Path]:
    return sorted(state_dir.glob(STATE_FILE + SET_ASIDE_MARK + "*"))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_an_unreadable_state_file_is_set_aside_and_the_front_starts_wholly_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    handed, good = written_state(tmp_path)
    bad = DAMAGE[damage](good)
    (tmp_path / STATE_FILE).write_bytes(bad)
    stats = GatewayStats()
    metrics = CollectorRegistry()
    register_gateway_metrics(metrics, stats)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        registry = Registry.open(tmp_path, stats)
    # The original bytes survive, private, under the set-aside name.
    (aside,) = set_asides(tmp_path)
    assert aside == registry.set_aside
    assert aside.read_bytes() == bad and aside.stat().st_mode & 0o777 == 0o600
    # Wholly fresh: nothing of a half-valid file applied.
    assert registry.clients == {} and registry.checkpoints == {} and registry.next_ids == {}
    # The new file is readable and says as much.
    fresh = decode_state((tmp_path / STATE_FILE).read_bytes())
    assert fresh.clients == {} and not fresh.clean
    # No id handed out before comes again.
    assert all(next(registry.checkpoint_ids(vb)) > handed[vb] for vb in handed)
    assert stats.tap_front_state_set_aside_total == 1
    assert value(scrape(metrics), "tapupr_tap_front_state_set_aside_total") == 1
    (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.levelno == logging.ERROR
    message = line.getMessage()
    assert str(tmp_path / STATE_FILE) in message and aside.name in message
    # Opened again, the new file reads: nothing more is set aside.
    registry.save(clean=True)
    again = Registry.open(tmp_path, stats)
    assert again.set_aside is None and len(set_asides(tmp_path)) == 1
    assert stats.tap_front_state_set_aside_total == 1


def test_each_unreadable_file_gets_its_own_set_aside_name(tmp_path: Path) -> None:
    for n in range(1, 4):
        (tmp_path / STATE_FILE).write_bytes(b"\xc1%d" % n)
        Registry.open(tmp_path)
        assert sorted(p.read_bytes() for p in set_asides(tmp_path)) == [
            b"\xc1%d" % i for i in range(1, n + 1)
        ]


def test_a_readable_file_is_never_set_aside(tmp_path: Path) -> None:
    handed, _ = written_state(tmp_path)
    registry = Registry.open(tmp_path)
    assert registry.set_aside is None and not set_asides(tmp_path)
    assert registry.positions("reg") is not None
    assert next(registry.checkpoint_ids(0)) == handed[0] + 1


@settings(max_examples=200, deadline=None)
@given(
    path=st.lists(st.sampled_from(["clients", "checkpoints", "next_ids", "first_id", "clean"])),
    junk=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),  # what msgpack carries
        st.floats(allow_nan=False),
        st.text(max_size=3),
        st.binary(max_size=3),
        st.lists(st.integers(-1, 3), max_size=7),
        st.dictionaries(st.integers(-1, 2**17), st.integers(-1, 3), max_size=2),
    ),
)
def test_decoding_any_damaged_field_either_reads_whole_or_says_why(
    path: list[str], junk: object
) -> None:
    """Replacing a field (or a part of it) with anything: a ``LoadedState`` whose
    every number is a 64-bit unsigned integer, or ``UnreadableState``, nothing else."""
    top: dict[str, object] = {
        "version": 1,
        "clients": {"reg": {0: [7, 5, 0, 5, 3, True]}},
        "checkpoints": {0: [[3, [7, 5, 0, 5, 3, True]]]},
        "next_ids": {0: 4},
        "first_id": 1,
        "clean": True,
    }
    if path:
        top[path[0]] = junk
    try:
        loaded = decode_state(msgpack.packb(top))
    except UnreadableState:
        return
    numbers = [*loaded.next_ids.values(), loaded.first_id]
    for positions in [*loaded.clients.values(), *loaded.checkpoints.values()]:
        for pos in positions.values():
            numbers += [pos.uuid, pos.seqno, pos.snap_start, pos.snap_end, pos.checkpoint_id]
            assert isinstance(pos.backfill_done, bool)
    assert all(type(n) is int and 0 <= n < 2**64 for n in numbers)
    assert isinstance(loaded.clean, bool)


# -- end to end: a client resuming from an id handed out before ---------------


async def run_front(
    node_port: int,
    state_dir: Path,
    stats: GatewayStats,
    scope: trio.CancelScope,
    stopped: trio.Event,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    config = TapFrontConfig(
        ("127.0.0.1", 0),
        ("127.0.0.1", node_port),
        state_dir=state_dir,
        backoff=0.05,
        noop_interval=0.5,
    )
    try:
        with scope:
            await TapFront(config, stats).serve(task_status=task_status)
    finally:
        stopped.set()  # the shutdown save is done


def closed_ids(events: list[TapEvent]) -> dict[int, int]:
    return {e.vbucket: e.checkpoint_id for e in events if isinstance(e, TapCheckpointEnd)}


async def test_a_client_resuming_from_an_id_in_a_lost_file_backfills(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(VBUCKETS)
    _, node_port = await start_node(nursery, store)
    state_dir = tmp_path / "gateway"
    flags = F.SUPPORT_ACK | F.CHECKPOINT
    with trio.fail_after(60):
        scope, stopped = trio.CancelScope(), trio.Event()
        port = await nursery.start(run_front, node_port, state_dir, GatewayStats(), scope, stopped)
        tap = await TapClient.open(port, connect_event(b"holder", flags))
        holder = HoldingClient(tap)
        nursery.start_soon(holder.run)
        await holder.wait_for(lambda: len(holder.events) >= 2)
        write_keys(store, b"seen", 40)
        await holder.wait_for(
            lambda: holder.mutations >= 40 and len(closed_ids(holder.events)) == VBUCKETS
        )
        last_closed = closed_ids(holder.events)
        scope.cancel()
        await stopped.wait()
        await holder.wait_for(lambda: holder.closed)
        path = state_dir / STATE_FILE
        path.write_bytes(DAMAGE["half_valid"](path.read_bytes()))
        missed = write_keys(store, b"missed", 40)  # while the gateway is down

        stats = GatewayStats()
        scope, stopped = trio.CancelScope(), trio.Event()
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            port = await nursery.start(run_front, node_port, state_dir, stats, scope, stopped)
        # Another client closes checkpoints on the restarted front first: ids as
        # high as the holder's (the same ids, were they counted from 1 again).
        tap = await TapClient.open(port, connect_event(b"other", flags))
        other = HoldingClient(tap)
        nursery.start_soon(other.run)
        await other.wait_for(lambda: len(other.events) >= 2)
        later = write_keys(store, b"later", 40)
        await other.wait_for(lambda: set(later) <= set(mutation_keys(other.events)))
        await other.wait_for(
            lambda: all(closed_ids(other.events).get(vb, 0) >= cp for vb, cp in last_closed.items())
        )
        back = await TapClient.open(
            port,
            connect_event(b"holder", flags, checkpoints=tuple(sorted(last_closed.items()))),
        )
        returned = HoldingClient(back)
        nursery.start_soon(returned.run)
        await returned.wait_for(lambda: len(returned.events) >= 2)
        final = write_keys(store, b"final", VBUCKETS)
        await returned.wait_for(lambda: set(final) <= set(mutation_keys(returned.events)))
        events = returned.events
        await back.aclose()
        scope.cancel()
        await stopped.wait()
    # Every vbucket backfilled from the start: nothing after the lost ids skipped.
    assert sorted(set(resets(events))) == list(range(VBUCKETS))
    assert set(missed) <= set(mutation_keys(events)), "resumed past items it never received"
    versions_in_order(holder.events + events)
    assert stats.tap_front_state_set_aside_total == 1
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    assert len(set_asides(state_dir)) == 1


@pytest.mark.parametrize("kept", [True, False], ids=["file-deleted", "no-state-dir"])
def test_a_state_started_without_a_file_never_hands_an_earlier_id_out_again(
    tmp_path: Path, kept: bool
) -> None:
    """A client may hold checkpoint ids of an earlier process that kept no file
    (no ``--state-dir``, or the file deleted): a fresh start hands out ids above
    them, so an old id never names a new range (it backfills instead)."""
    state_dir = tmp_path / "state" if kept else None
    before = Registry.open(state_dir)
    old = [next(before.checkpoint_ids(vb)) for vb in range(4) for _ in range(3)]
    if state_dir is not None:
        (state_dir / STATE_FILE).unlink()
    after = Registry.open(state_dir)
    new = [next(after.checkpoint_ids(vb)) for vb in range(4)]
    assert min(new) > max(old)


def test_the_state_file_is_private_and_its_rename_kept(tmp_path: Path) -> None:
    """The state file is written 0600 (it names clients), also over an older
    temporary file left with other permissions."""
    (tmp_path / (STATE_FILE + ".tmp")).write_bytes(b"left over")
    (tmp_path / (STATE_FILE + ".tmp")).chmod(0o644)
    registry = Registry.open(tmp_path)
    registry.register("client")
    registry.advance("client", 0, VbResume(1, 2, 2, 2))
    registry.save(clean=True)
    assert stat.S_IMODE((tmp_path / STATE_FILE).stat().st_mode) == 0o600
    assert not (tmp_path / (STATE_FILE + ".tmp")).exists()
