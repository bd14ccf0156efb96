"""The TAP front's pure parts: CONNECT planning and the registry's persistence."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.tap import ConnectFlags, TapConnect
from gateway.fronts.tap.plan import MAX_SEQNO, UpstreamVbucket, plan_connection
from gateway.fronts.tap.registry import ID_GAP, KEEP_CHECKPOINTS, Registry, VbResume

F = ConnectFlags
NOW = 1_800_000_000.0
UPSTREAM = {
    vb: UpstreamVbucket(vb, active=vb != 3, uuid=1000 + vb, high_seqno=10 * vb) for vb in range(4)
}

positions = st.builds(
    VbResume,
    uuid=st.integers(0, 2**48 - 1),
    seqno=st.integers(0, 2**40),
    snap_start=st.integers(0, 2**40),
    snap_end=st.integers(0, 2**40),
    checkpoint_id=st.integers(0, 2**32),
    backfill_done=st.booleans(),
)


@settings(max_examples=50, deadline=None)
@given(
    clients=st.dictionaries(
        st.text(min_size=1, max_size=8), st.dictionaries(st.integers(0, 1023), positions)
    ),
    closed=st.lists(st.tuples(st.integers(0, 1023), positions), max_size=100),
)
def test_registry_survives_a_restart(
    tmp_path_factory: pytest.TempPathFactory,
    clients: dict[str, dict[int, VbResume]],
    closed: list[tuple[int, VbResume]],
) -> None:
    state_dir = tmp_path_factory.mktemp("state")
    registry = Registry.open(state_dir)
    for name, vbs in clients.items():
        registry.register(name)
        for vb, position in vbs.items():
            registry.advance(name, vb, position)
    for vb, end in closed:
        registry.checkpoint_closed(vb, next(registry.checkpoint_ids(vb)), end)
    registry.save()
    again = Registry.open(state_dir)
    assert again.clients == registry.clients
    assert again.checkpoint_ends() == registry.checkpoint_ends()
    assert all(len(entries) <= KEEP_CHECKPOINTS for entries in again.checkpoints.values())
    for vb, _ in closed:  # ids never repeat across a restart
        assert next(again.checkpoint_ids(vb)) > max(again.checkpoints[vb])


def test_checkpoint_ids_after_an_unclean_stop_skip_what_may_have_been_handed_out(
    tmp_path: Path,
) -> None:
    registry = Registry.open(tmp_path)
    ids = registry.checkpoint_ids(0)
    handed = [next(ids) for _ in range(5)]  # never saved: the process is killed
    again = Registry.open(tmp_path)
    latest = next(again.checkpoint_ids(0))
    assert latest > max(handed) and next(again.checkpoint_ids(1)) > ID_GAP
    again.save(clean=True)
    # After a clean stop the counters go on where they were.
    assert next(Registry.open(tmp_path).checkpoint_ids(0)) == latest + 1


def test_an_unreadable_state_file_means_a_backfill_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "tap-front-state.msgpack").write_bytes(b"\xc1 not msgpack")
    assert Registry.open(tmp_path).clients == {}


@given(
    flags=st.integers(0, 0xFFFFFFFF).map(ConnectFlags),  # unknown bits included
    date=st.one_of(st.none(), st.just(0), st.just(int(NOW) + 10**6)),
    listed=st.lists(st.integers(0, 3), max_size=4),
)
def test_every_planned_start_is_a_valid_stream_request(
    flags: ConnectFlags, date: int | None, listed: list[int]
) -> None:
    """Unknown flag bits change nothing and a list of none means every vbucket, as
    ep-engine 2.x's ``createTapQueue`` and ``VBucketFilter`` (vbucket.hh) read them."""
    connect = TapConnect(b"c", flags, backfill_date=date, vbuckets=tuple(listed))
    try:
        plan = plan_connection(connect, "c", UPSTREAM, registered=None, checkpoint_ends={}, now=NOW)
    except ProtocolError as exc:
        assert exc.status is not None  # refused with a status, never anything else
        assert flags & F.TAKEOVER_VBUCKETS  # the one refusal left for known vbuckets
        return
    known = TapConnect(b"c", flags & 0x1FF, backfill_date=date, vbuckets=tuple(listed))
    assert (
        plan_connection(known, "c", UPSTREAM, registered=None, checkpoint_ends={}, now=NOW).starts
        == plan.starts
    )
    expected = listed if flags & F.LIST_VBUCKETS and listed else [0, 1, 2]
    assert [s.vbucket for s in plan.starts] == list(dict.fromkeys(expected))
    for start in plan.starts:
        assert start.snap_start <= start.start_seqno <= start.snap_end or start.backfill
        assert start.start_seqno <= start.end_seqno
        if flags & F.DUMP:
            state = UPSTREAM[start.vbucket]
            assert start.backfill and start.end_seqno == (state.high_seqno if state.active else 0)
        elif start.backfill:
            assert start.start_seqno == 0 and start.end_seqno == MAX_SEQNO


def test_registered_positions_win_and_checkpoint_resume_uses_the_recorded_end() -> None:
    mine = VbResume(uuid=1001, seqno=7, snap_start=5, snap_end=9, checkpoint_id=4)
    ended = VbResume(uuid=1002, seqno=15, snap_start=15, snap_end=15, checkpoint_id=6)
    connect = TapConnect(
        b"c",
        F.BACKFILL | F.CHECKPOINT | F.LIST_VBUCKETS,
        backfill_date=0,
        vbuckets=(1, 2, 0),
        checkpoints=((2, 6), (0, 99)),
    )
    plan = plan_connection(
        connect, "c", UPSTREAM, registered={1: mine}, checkpoint_ends={(2, 6): ended}, now=NOW
    )
    one, two, zero = plan.starts
    assert (one.start_seqno, one.uuid, one.snap_start, one.snap_end) == (7, 1001, 5, 9)
    assert one.resumed and not one.backfill
    assert (two.start_seqno, two.uuid) == (15, 1002) and not two.backfill
    assert zero.backfill and zero.start_seqno == 0  # an id the gateway never handed out


def test_a_listed_vbucket_the_upstream_lacks_is_skipped() -> None:
    """ep-engine 2.x src/tapconnection.cc ``TapProducer::registerCursor`` skips it."""
    plan = plan_connection(
        TapConnect(b"c", F.LIST_VBUCKETS | F.CHECKPOINT, vbuckets=(9, 0), checkpoints=((9, 1),)),
        "c", UPSTREAM, registered=None, checkpoint_ends={}, now=NOW,
    )  # fmt: skip
    assert [s.vbucket for s in plan.starts] == [0] and plan.skipped == (9,)


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ProtocolError, match="TAKEOVER_VBUCKETS needs a LIST_VBUCKETS list"):
        plan_connection(
            TapConnect(b"c", F.TAKEOVER_VBUCKETS), "c", UPSTREAM,
            registered=None, checkpoint_ends={}, now=NOW,
        )  # fmt: skip


@st.composite
def upstream_streams(draw: st.DrawFn) -> list[object]:
    """Snapshot markers (some asking for an ack) and the items under them."""
    from adapters import upr

    events: list[object] = []
    seqno = 0
    for index in range(draw(st.integers(1, 5))):
        size = draw(st.integers(1, 4))
        flags = upr.SnapshotFlags.DISK if index == 0 else upr.SnapshotFlags.MEMORY
        if draw(st.booleans()):
            flags |= upr.SnapshotFlags.ACK
        events.append(upr.SnapshotMarker(seqno + 1, seqno + size, flags, opaque=70 + index))
        for _ in range(size):
            seqno += 1
            events.append(upr.Mutation(b"k%d" % seqno, b"v", by_seqno=seqno, rev_seqno=1))
    return events


@given(upstream_streams(), st.integers(0, 40))
def test_positions_are_always_valid_resume_points_and_acks_come_once(
    events: list[object], cut: int
) -> None:
    import itertools

    from adapters import upr
    from gateway.fronts.tap.plan import VbStart
    from gateway.fronts.tap.vbstream import VbStream
    from gateway.metrics.figures import VbProgress

    stream = VbStream(
        VbStart.full(0), itertools.count(1), keys_only=False, network_byte_order=False,
        progress=VbProgress(),
    )  # fmt: skip
    stream.accepted(((77, 0),))
    replies = []
    for index, event in enumerate(events):
        if index == cut:  # the upstream went away here: the next request must be valid
            stream.prepare_resume()
            start = stream.start
            assert start.snap_start <= start.start_seqno <= start.snap_end
            assert start.uuid == 77 or start.start_seqno == 0
            break
        stream.translate(event)  # type: ignore[arg-type]
        reply = stream.reply_due(event)  # type: ignore[arg-type]
        if reply is not None:
            replies.append(reply.opaque)
        position = stream.position()
        assert position.snap_start <= position.seqno <= position.snap_end
    else:
        asked = [e.opaque for e in events if isinstance(e, upr.SnapshotMarker) and e.flags & 8]
        assert replies == asked  # every acked marker answered once, in order


def test_saves_from_the_loop_and_a_thread_never_collide_nor_go_back(tmp_path: Path) -> None:
    """A session's final save (on the loop) may meet the periodic save (a worker
    thread): neither fails, and the file ends with the newest positions."""
    registry = Registry.open(tmp_path)
    registry.register("client")
    images = []
    for seqno in range(1, 41):
        registry.advance("client", 0, VbResume(7, seqno, seqno, seqno))
        image = registry.image()
        assert image is not None
        images.append(image)
    # Writers racing in every order: oldest last included.
    barrier = threading.Barrier(8)

    def write_some(start: int) -> None:
        barrier.wait()
        for image in reversed(images[start::8]):
            registry.write(image)

    threads = [threading.Thread(target=write_some, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert registry.path is not None and not registry.path.with_suffix(".tmp").exists()
    reopened = Registry.open(tmp_path)
    assert reopened.positions("client") == {0: VbResume(7, 40, 40, 40)}
