"""Persistence: journal round trips, torn tails, compaction, fsync policies."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.node import recovery
from gateway.node.persistence import FILE_NAME, Journal
from gateway.node.store import Item, ItemKind, Store, VBucketState

NOW = 1_700_000_000.0
VBS = 8


def open_store(path: Path, seed: int = 1, **kwargs: object) -> Store:
    return Store(VBS, data_dir=str(path), rng=random.Random(seed), **kwargs)  # type: ignore[arg-type]


def snapshot(store: Store) -> dict[int, tuple[object, ...]]:
    return {
        vb: (
            store.state(vb),
            store.high_seqno(vb),
            store.snapshot(vb),
            tuple(store.items_since(vb, 0)),
        )
        for vb in range(store.n_vbuckets)
    }


def fill(store: Store) -> None:
    store.populate_sample(300, value_size=16, now=NOW)
    store.set(0, b"ttl", b"v", expiration=int(NOW) + 5, flags=9, now=NOW)
    store.set(0, b"gone", b"v", now=NOW)
    store.delete(0, b"gone", now=NOW)
    store.expire(NOW + 10)
    store.set_state(5, VBucketState.REPLICA, now=NOW)
    store.apply_mutation(
        5, b"rep", b"x", flags=1, expiration=0, cas=77, rev_seqno=12, by_seqno=1000, now=NOW
    )
    store.apply_deletion(5, b"rep2", cas=78, rev_seqno=3, kind=ItemKind.EXPIRATION, now=NOW)
    store.set_snapshot(5, 990, 1001)
    store.set_state(6, VBucketState.DEAD, now=NOW)


def test_round_trip_keeps_items_and_adds_a_failover_entry(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    fill(store)
    before = snapshot(store)
    logs = {vb: store.failover_log(vb) for vb in range(VBS)}
    cas = max(it.cas for vb in range(VBS) for it in store.items_since(vb, 0))
    store.close()

    again = open_store(tmp_path, seed=2)
    assert snapshot(again) == before
    for vb in range(VBS):
        log = again.failover_log(vb)
        assert log[1:] == logs[vb]
        assert log[0][1] == again.high_seqno(vb) and log[0][0] == again.uuid(vb)
        assert again.uuid(vb) not in {u for u, _ in logs[vb]}
    tomb = again.lookup(0, b"ttl")
    assert tomb is not None and tomb.kind is ItemKind.EXPIRATION and tomb.flags == 9
    # New writes continue after the old seqnos, CAS values and checkpoint ids.
    item = again.set(0, b"new", b"", now=0.0)
    assert item.by_seqno == before[0][1] + 1  # type: ignore[operator]
    assert item.cas > cas
    old_ids = [it.checkpoint_id for it in before[0][3]]  # type: ignore[attr-defined]
    assert item.checkpoint_id > max(old_ids)
    again.close()


def test_every_restart_adds_an_entry(tmp_path: Path) -> None:
    for n in range(3):
        store = open_store(tmp_path, seed=n)
        store.close()
    assert len(open_store(tmp_path, seed=9).failover_log(0)) == 4


def test_rollback_reset_purge_and_failover_are_persisted(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    for n in range(10):
        store.set(1, b"k%d" % n, b"", now=NOW)
    store.failover(1)
    store.rollback(1, 6)
    store.set(2, b"a", b"", now=NOW)
    store.reset_vbucket(2)
    store.set(3, b"a", b"", now=NOW)
    store.set(3, b"b", b"", now=NOW)
    store.delete(3, b"b", now=NOW)
    store.purge_tombstones(NOW + 1)
    store.replace_failover_log(4, [(5, 0)])
    before = snapshot(store)
    logs = {vb: store.failover_log(vb) for vb in range(VBS)}
    store.close()

    again = open_store(tmp_path, seed=3)
    assert snapshot(again) == before
    assert again.high_seqno(3) == 3  # the purged tombstone's seqno is not reused
    assert again.set(3, b"b", b"", now=NOW).rev_seqno == 3
    for vb in range(VBS):
        assert again.failover_log(vb)[1:] == logs[vb]
    again.close()


def test_torn_tail_is_cut_off(tmp_path: Path) -> None:
    store = open_store(tmp_path, fsync="always")
    for n in range(20):
        store.set(0, b"k%d" % n, b"v" * 50, now=NOW)
    store.close()
    path = tmp_path / FILE_NAME
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 10)  # the last record is torn

    again = open_store(tmp_path, seed=2)
    assert again.high_seqno(0) == 19
    assert [it.key for it in again.items_since(0, 17)] == [b"k17", b"k18"]
    again.set(0, b"after", b"", now=NOW)
    again.close()
    third = open_store(tmp_path, seed=3)
    assert third.lookup(0, b"after") is not None
    third.close()


def test_corrupt_record_ends_replay(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.set(0, b"a", b"AAAA", now=NOW)
    store.flush()
    size = (tmp_path / FILE_NAME).stat().st_size
    store.set(0, b"b", b"BBBB", now=NOW)
    store.set(0, b"c", b"CCCC", now=NOW)
    store.close()
    path = tmp_path / FILE_NAME
    data = bytearray(path.read_bytes())
    data[data.index(b"BBBB", size)] ^= 0xFF
    path.write_bytes(bytes(data))
    again = open_store(tmp_path, seed=2)
    assert [it.key for it in again.items_since(0, 0)] == [b"a"]
    again.close()


def test_compaction_is_atomic_and_keeps_state(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    for n in range(2000):
        store.set(n % VBS, b"k%d" % (n % 10), b"x" * 100, now=NOW)
    store.flush()
    path = tmp_path / FILE_NAME
    big = path.stat().st_size
    before = snapshot(store)
    store.compact()
    assert path.stat().st_size < big / 10
    assert not (tmp_path / (FILE_NAME + ".tmp")).exists()
    assert snapshot(store) == before
    store.set(0, b"after", b"", now=NOW)  # appends go to the new file
    after = snapshot(store)
    store.close()
    again = open_store(tmp_path, seed=2)
    assert snapshot(again) == after
    again.close()


def test_start_up_compacts_a_mostly_stale_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recovery, "_COMPACT_SLACK", 10)
    store = open_store(tmp_path)
    for n in range(500):
        store.set(0, b"same", b"%d" % n, now=NOW)
    store.close()
    size = (tmp_path / FILE_NAME).stat().st_size
    again = open_store(tmp_path, seed=2)
    assert (tmp_path / FILE_NAME).stat().st_size < size / 5
    assert again.get(0, b"same", NOW).value == b"499"
    again.close()


def test_leftover_temporary_file_is_ignored(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.set(0, b"a", b"", now=NOW)
    store.close()
    (tmp_path / (FILE_NAME + ".tmp")).write_bytes(b"half a compaction")
    again = open_store(tmp_path, seed=2)
    assert again.lookup(0, b"a") is not None
    assert not (tmp_path / (FILE_NAME + ".tmp")).exists()
    again.close()


def replayed_keys(path: Path) -> list[bytes]:
    return [rec[2] for rec in Journal(path).replay() if rec[0] == 1]


@pytest.mark.parametrize("policy", ["always", "batch", "never"])
def test_fsync_policies(tmp_path: Path, policy: str) -> None:
    store = open_store(tmp_path, fsync=policy)
    store.set(0, b"a", b"", now=NOW)
    on_disk = replayed_keys(tmp_path)
    assert (b"a" in on_disk) == (policy == "always")
    store.flush()
    assert b"a" in replayed_keys(tmp_path)
    store.close()


def test_batch_policy_flushes_on_time(tmp_path: Path) -> None:
    store = open_store(tmp_path, fsync="batch")
    store.set(0, b"a", b"", now=NOW)
    store.set(0, b"b", b"", now=NOW + 0.5)
    assert b"b" not in replayed_keys(tmp_path)
    store.maybe_close_checkpoints(NOW + 1.0)
    assert b"b" in replayed_keys(tmp_path)
    store.close()


def test_bad_fsync_policy(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync"):
        open_store(tmp_path, fsync="sometimes")


def test_vbucket_count_must_match(tmp_path: Path) -> None:
    open_store(tmp_path).close()
    with pytest.raises(ValueError, match="vbuckets"):
        Store(VBS * 2, data_dir=str(tmp_path), rng=random.Random(1))


def test_writes_after_close_fail(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError):
        store.set(0, b"a", b"", now=NOW)


def test_context_manager_closes(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        store.set(0, b"a", b"", now=NOW)
    assert isinstance(open_store(tmp_path, seed=2).lookup(0, b"a"), Item)
