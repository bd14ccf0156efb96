"""TAP -> UPR ingest translation: seqnos, duplicates, expirations, reconcile, replay."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.mcbp.constants import VBucketState
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlags,
    TapFlush,
    TapMutation,
    TapOpaque,
    TapVbucketSet,
)
from adapters.translate.log_records import (
    ItemKind,
    LogItem,
    LogMark,
    MarkKind,
    from_row,
    to_row,
)
from adapters.translate.tap_to_upr import TapToUpr, swap32

NBO = TapFlags.NETWORK_BYTE_ORDER
NOW = 1_700_000_000.0


def mutation(key: bytes, cas: int, value: bytes = b"v", exp: int = 0, rev: int = 1) -> TapMutation:
    return TapMutation(key, value, cas=cas, flags=7, expiration=exp, rev_seqno=rev, tap_flags=NBO)


def items(records: list) -> list[LogItem]:
    return [r for r in records if isinstance(r, LogItem)]


def feed_all(t: TapToUpr, messages: list, now: float = NOW) -> list:
    out: list = []
    for m in messages:
        out += t.feed(m, now)
    return out


def test_backfill_then_checkpoints_get_increasing_seqnos_and_origins() -> None:
    t = TapToUpr(0)
    out = feed_all(
        t,
        [
            TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM),
            mutation(b"a", 1),
            mutation(b"b", 2),
            TapOpaque(OpaqueCode.CLOSE_BACKFILL),
            TapCheckpointStart(5),
            mutation(b"a", 3, rev=2),
            TapDelete(b"b", cas=4, rev_seqno=2),
            TapCheckpointEnd(5),
        ],
    )
    logged = items(out)
    assert [i.by_seqno for i in logged] == [1, 2, 3, 4]
    assert [i.backfill for i in logged] == [True, True, False, False]
    assert [i.checkpoint_id for i in logged] == [0, 0, 5, 5]
    assert [i.checkpoint_start for i in logged] == [False, False, True, False]
    assert logged[3].kind is ItemKind.DELETION
    assert t.last_closed_checkpoint == 5 and t.high_seqno == 4
    assert out[0] == LogMark(MarkKind.BACKFILL_START, 0)
    assert out[-1] == LogMark(MarkKind.CHECKPOINT_END, 5)


def test_host_order_flags_are_swapped_to_network_order() -> None:
    t = TapToUpr(0)
    (item,) = t.feed(TapMutation(b"k", b"v", cas=1, flags=swap32(0x01020304)), NOW)
    assert isinstance(item, LogItem) and item.flags == 0x01020304


def test_resent_versions_keep_their_seqnos() -> None:
    t = TapToUpr(0)
    first = feed_all(t, [mutation(b"a", 1), mutation(b"b", 2), TapDelete(b"b", cas=3, rev_seqno=2)])
    again = feed_all(t, [mutation(b"a", 1), TapDelete(b"b", cas=3, rev_seqno=2)])
    assert len(items(first)) == 3 and again == [] and t.duplicates == 2
    assert feed_all(t, [mutation(b"a", 9, rev=2)])[0].by_seqno == 4


def test_delete_after_expiration_is_an_expiration() -> None:
    t = TapToUpr(0, expiry_tolerance=1.0)
    feed_all(t, [mutation(b"soon", 1, exp=int(NOW) - 5), mutation(b"later", 2, exp=int(NOW) + 60)])
    feed_all(t, [mutation(b"never", 3)])
    out = feed_all(
        t,
        [
            TapDelete(b"soon", cas=4, rev_seqno=2),
            TapDelete(b"later", cas=5, rev_seqno=2),
            TapDelete(b"never", cas=6, rev_seqno=2),
            TapDelete(b"unknown", cas=7, rev_seqno=1),
        ],
    )
    assert [i.kind for i in items(out)] == [
        ItemKind.EXPIRATION,
        ItemKind.DELETION,
        ItemKind.DELETION,
        ItemKind.DELETION,
    ]
    assert all(i.delete_time == int(NOW) for i in items(out))


def test_tolerance_covers_clock_skew() -> None:
    t = TapToUpr(0, expiry_tolerance=3.0)
    feed_all(t, [mutation(b"k", 1, exp=int(NOW) + 2)])
    (item,) = t.feed(TapDelete(b"k", cas=2, rev_seqno=2), NOW)
    assert isinstance(item, LogItem) and item.kind is ItemKind.EXPIRATION


def test_upstream_reset_reconciles_without_reusing_history() -> None:
    t = TapToUpr(0)
    feed_all(
        t,
        [
            TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM),
            mutation(b"same", 1),
            mutation(b"changed", 2),
            mutation(b"gone", 3),
            TapOpaque(OpaqueCode.CLOSE_BACKFILL),
        ],
    )
    out = feed_all(
        t,
        [
            TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM),
            mutation(b"same", 1),
            mutation(b"changed", 20, value=b"new", rev=2),
            mutation(b"fresh", 21),
            TapOpaque(OpaqueCode.CLOSE_BACKFILL),
        ],
    )
    assert out[0] == LogMark(MarkKind.BACKFILL_START, 1)
    logged = items(out)
    assert [(i.key, i.kind, i.by_seqno) for i in logged] == [
        (b"changed", ItemKind.MUTATION, 4),
        (b"fresh", ItemKind.MUTATION, 5),
        (b"gone", ItemKind.DELETION, 6),
    ]
    assert t.version(b"same").seqno == 1 and t.resetting is None


def test_flush_deletes_every_live_key() -> None:
    t = TapToUpr(0)
    feed_all(t, [mutation(b"a", 1), mutation(b"b", 2), TapDelete(b"b", cas=3, rev_seqno=2)])
    out = t.feed(TapFlush(), NOW)
    assert [(i.key, i.kind) for i in items(out)] == [(b"a", ItemKind.DELETION)]


def test_state_changes_are_marked() -> None:
    t = TapToUpr(0)
    assert t.feed(TapVbucketSet(VBucketState.PENDING), NOW) == [LogMark(MarkKind.STATE, 3)]
    assert t.state is VBucketState.PENDING


def test_interrupted_reset_is_known_after_replay() -> None:
    t = TapToUpr(0)
    feed_all(t, [mutation(b"a", 1)])
    records = feed_all(t, [TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM), mutation(b"a", 1)])
    again = TapToUpr(0)
    for r in [LogItem(1, ItemKind.MUTATION, b"a", cas=1, rev_seqno=1), *records]:
        again.replay(r)
    assert again.reset_interrupted and again.in_backfill


# -- properties ----------------------------------------------------------------

keys = st.sampled_from([b"k%d" % i for i in range(8)])
op = st.one_of(
    st.tuples(st.just("set"), keys, st.integers(0, 3)),
    st.tuples(st.just("del"), keys, st.just(0)),
    st.tuples(st.just("resend"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("checkpoint"), st.just(b""), st.just(0)),
)


class Upstream:
    """A TAP node in miniature: current versions, and everything it ever sent."""

    def __init__(self) -> None:
        self.cas = 0
        self.state: dict[bytes, tuple[int, int, bytes | None, int]] = {}
        self.sent: list = []

    def set(self, key: bytes, exp_code: int) -> TapMutation:
        self.cas += 1
        rev = self.state[key][1] + 1 if key in self.state else 1
        exp = {0: 0, 1: int(NOW) - 10, 2: int(NOW) + 3600, 3: 0}[exp_code]
        value = b"v%d" % self.cas
        self.state[key] = (self.cas, rev, value, exp)
        return TapMutation(key, value, cas=self.cas, expiration=exp, rev_seqno=rev, tap_flags=NBO)

    def delete(self, key: bytes) -> TapDelete:
        self.cas += 1
        rev = self.state[key][1] + 1 if key in self.state else 1
        self.state[key] = (self.cas, rev, None, 0)
        return TapDelete(key, cas=self.cas, rev_seqno=rev)


def latest(records: list[LogItem]) -> dict[bytes, tuple[int, bytes | None]]:
    out: dict[bytes, tuple[int, bytes | None]] = {}
    for r in records:
        out[r.key] = (r.cas, None if r.deleted else r.value)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=60))
def test_log_follows_upstream_and_replays_to_the_same_state(ops: list) -> None:
    node = Upstream()
    t = TapToUpr(0)
    records: list = []
    checkpoint = 1
    records += t.feed(TapCheckpointStart(checkpoint), NOW)
    for kind, key, arg in ops:
        if kind == "set":
            message = node.set(key, arg)
        elif kind == "del":
            message = node.delete(key)
        elif kind == "resend" and node.sent:
            # A resend is only ever of the latest version of its key.
            old = node.sent[arg % len(node.sent)]
            current = node.state[old.key]
            if old.cas != current[0]:
                continue
            message = old
        elif kind == "checkpoint":
            records += t.feed(TapCheckpointEnd(checkpoint), NOW)
            checkpoint += 1
            records += t.feed(TapCheckpointStart(checkpoint), NOW)
            continue
        else:
            continue
        node.sent.append(message)
        records += t.feed(message, NOW)
    logged = items(records)
    seqnos = [i.by_seqno for i in logged]
    assert seqnos == list(range(1, len(seqnos) + 1))
    assert latest(logged) == {k: (v[0], v[2]) for k, v in node.state.items()}
    # Every version logged once: as many items as distinct cas values sent.
    assert len(logged) == len({m.cas for m in node.sent})
    replayed = TapToUpr(0)
    for r in records:
        replayed.replay(from_row(msgpack.unpackb(msgpack.packb(to_row(r)))))
    assert replayed.index == t.index and replayed.high_seqno == t.high_seqno
    assert replayed.last_closed_checkpoint == t.last_closed_checkpoint


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(keys, st.integers(1, 3), max_size=8),
    st.dictionaries(keys, st.integers(1, 3), max_size=8),
)
def test_reset_reconciles_to_the_new_backfill(before: dict, after: dict) -> None:
    """Versions are (key, n): equal n means the node still has the same version."""

    def msg(key: bytes, n: int) -> TapMutation:
        cas = hash((key, n)) & 0xFFFFFFFF
        return TapMutation(key, b"%d" % n, cas=cas, rev_seqno=n, tap_flags=NBO)

    t = TapToUpr(0)
    first = feed_all(t, [TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM)])
    first += feed_all(t, [msg(k, n) for k, n in before.items()])
    first += feed_all(t, [TapOpaque(OpaqueCode.CLOSE_BACKFILL)])
    seqno_before = {i.key: i.by_seqno for i in items(first)}
    high = t.high_seqno
    second = feed_all(t, [TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM)])
    second += feed_all(t, [msg(k, n) for k, n in after.items()])
    second += feed_all(t, [TapOpaque(OpaqueCode.CLOSE_BACKFILL)])
    final = latest(items(first + second))
    assert {k: v for k, (_, v) in final.items() if v is not None} == {
        k: b"%d" % n for k, n in after.items()
    }
    for key, n in after.items():
        if before.get(key) == n:
            assert t.version(key).seqno == seqno_before[key]  # unchanged: same seqno
    assert all(i.by_seqno > high for i in items(second))
