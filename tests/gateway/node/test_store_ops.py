"""Store operations: memcached semantics, replication apply, expiry, limits."""

from __future__ import annotations

import random

import pytest

from adapters.errors import GatewayError
from adapters.mcbp.constants import Status
from gateway.node.store import Item, ItemKind, Store, StoreError, VBucketState, vbucket_of

NOW = 1_700_000_000.0


@pytest.fixture
def store() -> Store:
    return Store(4, rng=random.Random(7))


def status_of(excinfo: pytest.ExceptionInfo[StoreError]) -> Status:
    return excinfo.value.status


# -- memcached commands -------------------------------------------------------


def test_set_then_get(store: Store) -> None:
    item = store.set(1, b"k", b"v", flags=0xDEADBEEF, expiration=0, now=NOW)
    assert item == store.get(1, b"k", NOW)
    assert (item.by_seqno, item.rev_seqno, item.flags, item.kind) == (
        1,
        1,
        0xDEADBEEF,
        ItemKind.MUTATION,
    )
    assert item.vbucket == 1 and item.checkpoint_id == 1


def test_get_missing_key(store: Store) -> None:
    with pytest.raises(StoreError) as exc:
        store.get(0, b"nope", NOW)
    assert status_of(exc) is Status.KEY_NOT_FOUND


def test_store_error_is_a_gateway_error() -> None:
    err = StoreError(Status.NO_MEMORY)
    assert isinstance(err, GatewayError)
    assert err.status is Status.NO_MEMORY
    assert "no_memory" in str(err)


def test_every_change_bumps_seqno_rev_and_cas(store: Store) -> None:
    a = store.set(0, b"k", b"1", now=NOW)
    b = store.set(0, b"k", b"2", now=NOW)
    c = store.touch(0, b"k", int(NOW) + 100, now=NOW)
    d = store.delete(0, b"k", now=NOW + 1)
    assert [x.by_seqno for x in (a, b, c, d)] == [1, 2, 3, 4]
    assert [x.rev_seqno for x in (a, b, c, d)] == [1, 2, 3, 4]
    cas = [x.cas for x in (a, b, c, d)]
    assert cas == sorted(set(cas))
    assert c.value == b"2" and c.expiration == int(NOW) + 100
    assert d.kind is ItemKind.DELETION and d.value == b"" and d.delete_time == int(NOW) + 1


def test_cas_is_unique_across_vbuckets_and_follows_the_clock(store: Store) -> None:
    first = store.set(0, b"a", b"", now=NOW)
    second = store.set(1, b"b", b"", now=NOW)
    assert second.cas > first.cas
    # Nanoseconds of the clock, low 16 bits a counter.
    assert first.cas >> 16 == int(NOW * 1e9) >> 16
    later = store.set(2, b"c", b"", now=NOW - 100)  # a clock going back does not
    assert later.cas > second.cas


def test_set_with_cas(store: Store) -> None:
    item = store.set(0, b"k", b"1", now=NOW)
    with pytest.raises(StoreError) as exc:
        store.set(0, b"k", b"2", cas=item.cas + 1, now=NOW)
    assert status_of(exc) is Status.KEY_EXISTS
    assert store.set(0, b"k", b"2", cas=item.cas, now=NOW).value == b"2"
    with pytest.raises(StoreError) as exc:
        store.set(0, b"missing", b"2", cas=123, now=NOW)
    assert status_of(exc) is Status.KEY_NOT_FOUND


def test_add(store: Store) -> None:
    store.add(0, b"k", b"1", now=NOW)
    with pytest.raises(StoreError) as exc:
        store.add(0, b"k", b"2", now=NOW)
    assert status_of(exc) is Status.KEY_EXISTS
    with pytest.raises(StoreError) as exc:
        store.add(0, b"other", b"2", cas=5, now=NOW)
    assert status_of(exc) is Status.ITEM_NOT_STORED
    store.delete(0, b"k", now=NOW)
    again = store.add(0, b"k", b"3", now=NOW)
    assert again.rev_seqno == 3  # continues after the tombstone's


def test_add_over_expired_item(store: Store) -> None:
    store.set(0, b"k", b"1", expiration=int(NOW) + 5, now=NOW)
    assert store.add(0, b"k", b"2", now=NOW + 10).value == b"2"


def test_replace(store: Store) -> None:
    with pytest.raises(StoreError) as exc:
        store.replace(0, b"k", b"1", now=NOW)
    assert status_of(exc) is Status.KEY_NOT_FOUND
    item = store.set(0, b"k", b"1", now=NOW)
    with pytest.raises(StoreError) as exc:
        store.replace(0, b"k", b"2", cas=item.cas - 1, now=NOW)
    assert status_of(exc) is Status.KEY_EXISTS
    assert store.replace(0, b"k", b"2", cas=item.cas, now=NOW).value == b"2"
    assert store.replace(0, b"k", b"3", now=NOW).value == b"3"


def test_delete(store: Store) -> None:
    with pytest.raises(StoreError) as exc:
        store.delete(0, b"k", now=NOW)
    assert status_of(exc) is Status.KEY_NOT_FOUND
    item = store.set(0, b"k", b"1", now=NOW)
    with pytest.raises(StoreError) as exc:
        store.delete(0, b"k", cas=item.cas + 1, now=NOW)
    assert status_of(exc) is Status.KEY_EXISTS
    tomb = store.delete(0, b"k", cas=item.cas, now=NOW)
    assert store.lookup(0, b"k") == tomb
    with pytest.raises(StoreError) as exc:
        store.get(0, b"k", NOW)
    assert status_of(exc) is Status.KEY_NOT_FOUND
    with pytest.raises(StoreError) as exc:
        store.delete(0, b"k", now=NOW)
    assert status_of(exc) is Status.KEY_NOT_FOUND


def test_touch_missing(store: Store) -> None:
    with pytest.raises(StoreError) as exc:
        store.touch(0, b"k", 0, now=NOW)
    assert status_of(exc) is Status.KEY_NOT_FOUND


def test_value_too_large() -> None:
    store = Store(1, max_value_size=10, rng=random.Random(1))
    with pytest.raises(StoreError) as exc:
        store.set(0, b"k", b"x" * 11, now=NOW)
    assert status_of(exc) is Status.VALUE_TOO_LARGE


@pytest.mark.parametrize("state", [VBucketState.REPLICA, VBucketState.PENDING, VBucketState.DEAD])
def test_client_ops_need_an_active_vbucket(store: Store, state: VBucketState) -> None:
    store.set(0, b"k", b"1", now=NOW)
    store.set_state(0, state, now=NOW)
    calls = [
        lambda: store.get(0, b"k", NOW),
        lambda: store.set(0, b"k", b"2", now=NOW),
        lambda: store.add(0, b"n", b"2", now=NOW),
        lambda: store.replace(0, b"k", b"2", now=NOW),
        lambda: store.delete(0, b"k", now=NOW),
        lambda: store.touch(0, b"k", 0, now=NOW),
    ]
    for call in calls:
        with pytest.raises(StoreError) as exc:
            call()
        assert status_of(exc) is Status.NOT_MY_VBUCKET


def test_unknown_vbucket(store: Store) -> None:
    with pytest.raises(StoreError) as exc:
        store.set(4, b"k", b"1", now=NOW)
    assert status_of(exc) is Status.NOT_MY_VBUCKET
    with pytest.raises(StoreError) as exc:
        store.high_seqno(-1)
    assert status_of(exc) is Status.NOT_MY_VBUCKET
    assert store.vbucket(4) is None


# -- expiry ---------------------------------------------------------------------


def test_get_of_expired_item_expires_it(store: Store) -> None:
    seen: list[tuple[int, int]] = []
    store.set(0, b"k", b"1", expiration=int(NOW) + 10, now=NOW)
    assert store.get(0, b"k", NOW + 9).value == b"1"
    store.add_listener(lambda vb, seqno: seen.append((vb, seqno)))
    with pytest.raises(StoreError) as exc:
        store.get(0, b"k", NOW + 10)
    assert status_of(exc) is Status.KEY_NOT_FOUND
    tomb = store.lookup(0, b"k")
    assert tomb is not None and tomb.kind is ItemKind.EXPIRATION and tomb.by_seqno == 2
    assert tomb.rev_seqno == 2 and tomb.delete_time == int(NOW) + 10
    assert seen == [(0, 2)]
    assert store.expire(NOW + 100) == []  # already expired by the read


def test_replace_and_delete_of_expired_item(store: Store) -> None:
    store.set(0, b"k", b"1", expiration=int(NOW) + 1, now=NOW)
    with pytest.raises(StoreError) as exc:
        store.replace(0, b"k", b"2", now=NOW + 2)
    assert status_of(exc) is Status.KEY_NOT_FOUND
    with pytest.raises(StoreError) as exc:
        store.delete(0, b"k", now=NOW + 2)
    assert status_of(exc) is Status.KEY_NOT_FOUND


def test_expiry_pager(store: Store) -> None:
    for i in range(10):
        store.set(i % 4, b"k%d" % i, b"v", expiration=int(NOW) + i, now=NOW)
    store.set(0, b"forever", b"v", now=NOW)
    store.set(0, b"k0", b"v", expiration=0, now=NOW)  # TTL removed: not expired
    assert store.expire(NOW) == []  # k0 no longer has a TTL
    first = store.expire(NOW + 5, limit=3)
    assert [it.key for it in first] == [b"k1", b"k2", b"k3"]
    assert all(it.kind is ItemKind.EXPIRATION for it in first)
    rest = store.expire(NOW + 5)
    assert [it.key for it in rest] == [b"k4", b"k5"]
    for it in first + rest:
        assert store.lookup(it.vbucket, it.key) == it
        assert it.rev_seqno == 2 and it.delete_time == int(NOW) + 5
    assert store.get(0, b"forever", NOW + 10**6).value == b"v"


def test_expiry_pager_skips_replicas_until_they_become_active(store: Store) -> None:
    store.set_state(1, VBucketState.REPLICA, now=NOW)
    store.apply_mutation(
        1, b"k", b"v", flags=0, expiration=int(NOW) + 1, cas=5, rev_seqno=3, now=NOW
    )
    assert store.expire(NOW + 10) == []
    store.set_state(1, VBucketState.ACTIVE, now=NOW + 10)
    expired = store.expire(NOW + 10)
    assert [(it.key, it.rev_seqno) for it in expired] == [(b"k", 4)]


def test_expiry_queue_stays_bounded(store: Store) -> None:
    for n in range(5000):
        store.set(0, b"k", b"v", expiration=int(NOW) + 1000 + n, now=NOW)
    store.expire(NOW)
    assert store.stats().expiry_queue <= 1024


# -- tombstones and the item limit ------------------------------------------------


def test_purge_tombstones(store: Store) -> None:
    store.set(0, b"a", b"1", now=NOW)
    store.set(0, b"b", b"1", now=NOW)
    store.delete(0, b"a", now=NOW)
    store.delete(0, b"b", now=NOW + 100)
    assert store.vbucket_stats(0).tombstones == 2
    assert store.purge_tombstones(NOW + 50) == 1
    assert store.lookup(0, b"a") is None
    assert [it.key for it in store.items_since(0, 0)] == [b"b"]
    # A re-created key's rev seqno stays above the purged tombstone's.
    assert store.set(0, b"a", b"new", now=NOW).rev_seqno == 3
    assert store.purge_tombstones(NOW + 1000, vb=0) == 1


def test_max_items_counts_tombstones() -> None:
    store = Store(2, max_items=3, rng=random.Random(1))
    store.set(0, b"a", b"1", now=NOW)
    store.set(1, b"b", b"1", now=NOW)
    store.set(0, b"c", b"1", now=NOW)
    with pytest.raises(StoreError) as exc:
        store.set(1, b"d", b"1", now=NOW)
    assert status_of(exc) is Status.NO_MEMORY
    store.set(0, b"a", b"2", now=NOW)  # overwrites do not add
    store.delete(0, b"a", now=NOW)  # nor does a delete: the tombstone stays
    with pytest.raises(StoreError) as exc:
        store.add(1, b"d", b"1", now=NOW)
    assert status_of(exc) is Status.NO_MEMORY
    assert store.purge_tombstones(NOW + 1) == 1
    store.set(1, b"d", b"1", now=NOW)
    assert store.stats().items == 3


# -- replication --------------------------------------------------------------------


def test_apply_mutation_keeps_source_metadata(store: Store) -> None:
    store.set_state(2, VBucketState.REPLICA, now=NOW)
    item = store.apply_mutation(
        2,
        b"k",
        b"v",
        flags=7,
        expiration=123,
        cas=999,
        rev_seqno=42,
        lock_time=3,
        datatype=1,
        now=NOW,
    )
    assert (item.by_seqno, item.rev_seqno, item.cas, item.flags, item.expiration) == (
        1,
        42,
        999,
        7,
        123,
    )
    assert (item.lock_time, item.datatype) == (3, 1)
    assert store.lookup(2, b"k") == item
    # Local CAS values stay above every CAS seen.
    store.set(0, b"x", b"", now=0.0)
    assert store.lookup(0, b"x").cas > 999  # type: ignore[union-attr]


def test_apply_with_source_seqnos(store: Store) -> None:
    store.set_state(0, VBucketState.REPLICA, now=NOW)
    store.apply_mutation(
        0, b"a", b"1", flags=0, expiration=0, cas=1, rev_seqno=1, by_seqno=10, now=NOW
    )
    tomb = store.apply_deletion(
        0, b"a", cas=2, rev_seqno=2, by_seqno=15, kind=ItemKind.EXPIRATION, delete_time=5, now=NOW
    )
    assert (tomb.by_seqno, tomb.kind, tomb.delete_time) == (15, ItemKind.EXPIRATION, 5)
    assert store.high_seqno(0) == 15
    with pytest.raises(StoreError) as exc:
        store.apply_mutation(
            0, b"b", b"", flags=0, expiration=0, cas=3, rev_seqno=1, by_seqno=15, now=NOW
        )
    assert status_of(exc) is Status.RANGE_ERROR
    local = store.apply_deletion(0, b"unknown", cas=4, rev_seqno=9, now=NOW)
    assert (
        local.by_seqno == 16 and local.kind is ItemKind.DELETION and local.delete_time == int(NOW)
    )


def test_apply_refused_on_dead_vbucket(store: Store) -> None:
    store.set_state(3, VBucketState.DEAD, now=NOW)
    with pytest.raises(StoreError) as exc:
        store.apply_mutation(3, b"k", b"v", flags=0, expiration=0, cas=1, rev_seqno=1, now=NOW)
    assert status_of(exc) is Status.NOT_MY_VBUCKET
    with pytest.raises(StoreError) as exc:
        store.apply_deletion(3, b"k", cas=1, rev_seqno=1, now=NOW)
    assert status_of(exc) is Status.NOT_MY_VBUCKET


def test_apply_deletion_rejects_mutation_kind(store: Store) -> None:
    with pytest.raises(ValueError):
        store.apply_deletion(0, b"k", cas=1, rev_seqno=1, kind=ItemKind.MUTATION, now=NOW)


@pytest.mark.parametrize("state", [VBucketState.ACTIVE, VBucketState.PENDING])
def test_apply_allowed_in_active_and_pending(store: Store, state: VBucketState) -> None:
    store.set_state(0, state, now=NOW)
    store.apply_mutation(0, b"k", b"v", flags=0, expiration=0, cas=1, rev_seqno=1, now=NOW)
    assert store.high_seqno(0) == 1


def test_reset_vbucket(store: Store) -> None:
    store.set(0, b"a", b"1", now=NOW)
    store.set(1, b"b", b"1", now=NOW)
    old_uuid = store.uuid(0)
    store.reset_vbucket(0)
    assert store.high_seqno(0) == 0 and store.items_since(0, 0) == []
    assert store.uuid(0) != old_uuid and store.failover_log(0) == ((store.uuid(0), 0),)
    assert store.checkpoints(0)[-1].id == 1
    assert store.stats().items == 1
    assert store.set(0, b"a", b"2", now=NOW).by_seqno == 1


def test_rollback(store: Store) -> None:
    for n, key in enumerate([b"a", b"b", b"c", b"d"], start=1):
        store.set(0, key, b"%d" % n, now=NOW)
    store.set(0, b"b", b"again", now=NOW)  # b's latest version is seqno 5
    assert store.rollback(0, 3) == 3
    # Only latest versions exist: b's version 2 is gone with version 5.
    assert [it.key for it in store.items_since(0, 0)] == [b"a", b"c"]
    assert store.lookup(0, b"b") is None and store.lookup(0, b"d") is None
    assert store.stats().items == 2
    assert store.set(0, b"e", b"", now=NOW).by_seqno == 4
    assert store.rollback(0, 10) == 4  # nothing above: no change


def test_rollback_prunes_failover_log() -> None:
    store = Store(1, rng=random.Random(3))
    store.set(0, b"a", b"", now=NOW)
    store.set(0, b"b", b"", now=NOW)
    store.failover(0)
    store.set(0, b"c", b"", now=NOW)
    log = store.failover_log(0)
    assert [s for _, s in log] == [2, 0]
    store.rollback(0, 1)
    assert store.failover_log(0) == log[1:]


def test_replace_failover_log(store: Store) -> None:
    store.replace_failover_log(0, [(11, 5), (10, 0)])
    assert store.failover_log(0) == ((11, 5), (10, 0)) and store.uuid(0) == 11


def test_snapshot_resume_point(store: Store) -> None:
    assert store.snapshot(0) == (0, 0)
    store.set_snapshot(0, 5, 9)
    assert store.snapshot(0) == (5, 9)
    assert store.vbucket_stats(0).snapshot_end == 9


# -- states, listeners, stats, sample data -----------------------------------------


def test_set_state_adds_failover_entry_only_on_becoming_active(store: Store) -> None:
    store.set(0, b"a", b"", now=NOW)
    assert len(store.failover_log(0)) == 1
    store.set_state(0, VBucketState.ACTIVE, now=NOW)
    assert len(store.failover_log(0)) == 1
    store.set_state(0, VBucketState.REPLICA, now=NOW)
    store.set_state(0, VBucketState.PENDING, now=NOW)
    assert len(store.failover_log(0)) == 1
    store.set_state(0, VBucketState.ACTIVE, now=NOW)
    log = store.failover_log(0)
    assert len(log) == 2 and log[0] == (store.uuid(0), 1)
    assert store.state(0) is VBucketState.ACTIVE


def test_initial_state_option() -> None:
    store = Store(2, initial_state=VBucketState.REPLICA, rng=random.Random(1))
    assert store.stats().replica == 2


def test_listeners(store: Store) -> None:
    seen: list[tuple[int, int]] = []

    def listener(vb: int, seqno: int) -> None:
        seen.append((vb, seqno))

    store.add_listener(listener)
    store.set(1, b"a", b"", now=NOW)
    store.delete(1, b"a", now=NOW)
    store.set_state(2, VBucketState.REPLICA, now=NOW)
    store.apply_mutation(2, b"x", b"", flags=0, expiration=0, cas=1, rev_seqno=1, now=NOW)
    store.rollback(2, 0)
    assert seen == [(1, 1), (1, 2), (2, 0), (2, 1), (2, 0)]
    store.remove_listener(listener)
    store.set(1, b"b", b"", now=NOW)
    assert len(seen) == 5


def test_stats(store: Store) -> None:
    store.set(0, b"a", b"12345", now=NOW)
    store.set(0, b"b", b"", now=NOW)
    store.delete(0, b"b", now=NOW)
    vb = store.vbucket_stats(0)
    assert (vb.items, vb.tombstones, vb.high_seqno, vb.state) == (1, 1, 3, VBucketState.ACTIVE)
    assert vb.uuid == store.uuid(0) and vb.failover_entries == 1
    assert vb.open_checkpoint_id == 1 and vb.last_closed_checkpoint_id == 0
    assert vb.memory_bytes > len(b"a12345b")
    total = store.stats()
    assert (total.vbuckets, total.active, total.items, total.tombstones) == (4, 4, 1, 1)
    assert total.memory_bytes == vb.memory_bytes


def test_vbucket_of_is_the_client_hash() -> None:
    import zlib

    for key in (b"", b"foo", b"sample::000123"):
        assert vbucket_of(key, 1024) == ((zlib.crc32(key) >> 16) & 0x7FFF) % 1024


def test_populate_sample_is_deterministic_and_spread() -> None:
    one = Store(16, rng=random.Random(1))
    two = Store(16, rng=random.Random(2))
    assert one.populate_sample(500, value_size=20, rng=random.Random(5)) == 500
    two.populate_sample(500, value_size=20, rng=random.Random(5))
    for vb in range(16):
        a = [(it.key, it.value) for it in one.items_since(vb, 0)]
        assert a == [(it.key, it.value) for it in two.items_since(vb, 0)]
        assert all(vbucket_of(key, 16) == vb for key, _ in a)
        assert all(len(value) == 20 for _, value in a)
    assert one.lookup(vbucket_of(b"sample::000123", 16), b"sample::000123") is not None
    assert sum(1 for vb in range(16) if one.high_seqno(vb)) > 8


def test_populate_sample_skips_inactive_vbuckets() -> None:
    store = Store(4, rng=random.Random(1))
    store.set_state(0, VBucketState.REPLICA, now=NOW)
    written = store.populate_sample(100)
    assert written == 100 - sum(1 for i in range(100) if vbucket_of(b"sample::%06d" % i, 4) == 0)
    assert store.high_seqno(0) == 0


def test_1024_vbuckets() -> None:
    store = Store(1024, rng=random.Random(1))
    store.populate_sample(3000, value_size=8)
    assert store.stats().items == 3000
    assert len({store.uuid(vb) for vb in range(1024)}) == 1024


def test_items_since_with_limit_and_end(store: Store) -> None:
    for n in range(20):
        store.set(0, b"k%d" % (n % 7), b"", now=NOW)
    latest = store.items_since(0, 0)
    assert [it.by_seqno for it in latest] == list(range(14, 21))
    assert store.items_since(0, 15, limit=2) == latest[2:4]
    assert store.items_since(0, 0, end=16) == latest[:3]
    assert store.items_since(0, 20) == []
    assert isinstance(latest[0], Item)


def test_seqno_index_survives_heavy_overwrites() -> None:
    store = Store(1, rng=random.Random(1))
    for n in range(5000):
        store.set(0, b"k%d" % (n % 50), b"%d" % n, now=NOW)
        if n == 3000:
            store.delete(0, b"k7", now=NOW)
    index = store.vbucket(0)._log  # type: ignore[union-attr]
    assert len(index) < 2 * 1024 + 100  # stale versions were dropped along the way
    latest = store.items_since(0, 0)
    assert [it.by_seqno for it in latest] == list(range(4952, 5002))
    assert store.items_since(0, 4960, limit=5) == latest[9:14]
    assert store.items_since(0, 100, limit=3) == latest[:3]
    assert store.rollback(0, 4990) == 4990
    assert [it.by_seqno for it in store.items_since(0, 0)] == list(range(4952, 4991))
