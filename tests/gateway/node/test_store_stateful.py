"""Random operation sequences against a plain dict model of the store.

The model keeps, per vbucket, each key's latest (seqno, kind, value,
expiration, delete_time) and the high seqno; the store must agree after
every step, and its own invariants (seqno order, one entry per key in the
seqno index, failover log shape, rollback decisions) must hold throughout.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from adapters.mcbp.constants import Status
from adapters.upr.failover_log import MAX_ENTRIES, rollback_decision
from gateway.node.store import ItemKind, Store, StoreError, VBucketState

VBS = 3
KEYS = [b"a", b"b", b"c", b"d", b"e", b"f"]

vbuckets = st.integers(0, VBS - 1)
keys = st.sampled_from(KEYS)
values = st.binary(max_size=4)


@dataclass
class Version:
    seqno: int
    kind: ItemKind
    value: bytes
    expiration: int
    delete_time: int


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = Store(VBS, checkpoint_items=4, checkpoint_seconds=3.0, rng=random.Random(0))
        self.now = 1000.0
        self.model: list[dict[bytes, Version]] = [{} for _ in range(VBS)]
        self.high = [0] * VBS
        self.states = [VBucketState.ACTIVE] * VBS

    # -- helpers -------------------------------------------------------------------

    def _write(
        self,
        vb: int,
        key: bytes,
        seqno: int,
        kind: ItemKind,
        value: bytes = b"",
        expiration: int = 0,
    ) -> None:
        assert seqno > self.high[vb], "by_seqno must grow strictly within a vbucket"
        delete_time = int(self.now) if kind is not ItemKind.MUTATION else 0
        self.model[vb][key] = Version(seqno, kind, value, expiration, delete_time)
        self.high[vb] = seqno

    def _live(self, vb: int, key: bytes) -> Version | None:
        version = self.model[vb].get(key)
        if version is None or version.kind is not ItemKind.MUTATION:
            return None
        return version

    def _expired(self, version: Version) -> bool:
        return 0 < version.expiration <= self.now

    # -- rules -------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 4.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(vb=vbuckets, key=keys, value=values, ttl=st.sampled_from([0, 0, 1, 3]))
    def set(self, vb: int, key: bytes, value: bytes, ttl: int) -> None:
        expiration = int(self.now) + ttl if ttl else 0
        if self.states[vb] is not VBucketState.ACTIVE:
            try:
                self.store.set(vb, key, value, expiration=expiration, now=self.now)
            except StoreError as exc:
                assert exc.status is Status.NOT_MY_VBUCKET
                return
            raise AssertionError("set on an inactive vbucket succeeded")
        item = self.store.set(vb, key, value, expiration=expiration, now=self.now)
        assert item.by_seqno == self.high[vb] + 1
        self._write(vb, key, item.by_seqno, ItemKind.MUTATION, value, expiration)

    @rule(vb=vbuckets, key=keys)
    def delete(self, vb: int, key: bytes) -> None:
        if self.states[vb] is not VBucketState.ACTIVE:
            return
        live = self._live(vb, key)
        try:
            item = self.store.delete(vb, key, now=self.now)
        except StoreError as exc:
            assert exc.status is Status.KEY_NOT_FOUND
            assert live is None or self._expired(live)
            if live is not None:  # the delete found it expired and expired it
                self._write(vb, key, self.high[vb] + 1, ItemKind.EXPIRATION)
            return
        assert live is not None and not self._expired(live)
        assert item.kind is ItemKind.DELETION
        self._write(vb, key, item.by_seqno, ItemKind.DELETION)

    @rule(vb=vbuckets, key=keys)
    def get(self, vb: int, key: bytes) -> None:
        if self.states[vb] is not VBucketState.ACTIVE:
            return
        live = self._live(vb, key)
        try:
            item = self.store.get(vb, key, self.now)
        except StoreError as exc:
            assert exc.status is Status.KEY_NOT_FOUND
            if live is not None:
                assert self._expired(live)
                self._write(vb, key, self.high[vb] + 1, ItemKind.EXPIRATION)
            return
        assert live is not None and not self._expired(live)
        assert item.value == live.value and item.by_seqno == live.seqno

    @rule(limit=st.integers(1, 5))
    def expire(self, limit: int) -> None:
        due = sorted(
            (version.expiration, vb, version.seqno, key)
            for vb in range(VBS)
            if self.states[vb] is VBucketState.ACTIVE
            for key, version in self.model[vb].items()
            if version.kind is ItemKind.MUTATION and self._expired(version)
        )
        expired = self.store.expire(self.now, limit)
        assert [(it.vbucket, it.key) for it in expired] == [(vb, k) for _, vb, _, k in due[:limit]]
        for item in expired:
            assert item.kind is ItemKind.EXPIRATION
            self._write(item.vbucket, item.key, item.by_seqno, ItemKind.EXPIRATION)

    @rule(vb=vbuckets, key=keys, value=values, gap=st.integers(1, 3))
    def apply_with_source_seqno(self, vb: int, key: bytes, value: bytes, gap: int) -> None:
        if self.states[vb] is VBucketState.ACTIVE:
            return
        seqno = self.high[vb] + gap
        self.store.apply_mutation(
            vb, key, value, flags=0, expiration=0, cas=1, rev_seqno=1, by_seqno=seqno, now=self.now
        )
        self._write(vb, key, seqno, ItemKind.MUTATION, value)

    @rule(vb=vbuckets, active=st.booleans())
    def set_state(self, vb: int, active: bool) -> None:
        state = VBucketState.ACTIVE if active else VBucketState.REPLICA
        before = self.store.failover_log(vb)
        self.store.set_state(vb, state, now=self.now)
        became_active = active and self.states[vb] is not VBucketState.ACTIVE
        log = self.store.failover_log(vb)
        if became_active:
            assert log[0] == (self.store.uuid(vb), self.high[vb])
            assert log[1:] == before[: MAX_ENTRIES - 1]
        else:
            assert log == before
        self.states[vb] = state

    @rule()
    def close_checkpoints_on_time(self) -> None:
        self.store.maybe_close_checkpoints(self.now)

    @rule(vb=vbuckets)
    def close_checkpoint(self, vb: int) -> None:
        before = self.store.checkpoints(vb)[-1].id
        assert self.store.close_checkpoint(vb) == before + 1

    @rule(vb=vbuckets)
    def failover(self, vb: int) -> None:
        uuid = self.store.failover(vb)
        assert self.store.failover_log(vb)[0] == (uuid, self.high[vb])

    @rule(vb=vbuckets, data=st.data())
    def rollback(self, vb: int, data: st.DataObject) -> None:
        seqno = data.draw(st.integers(0, self.high[vb]))
        assert self.store.rollback(vb, seqno) == seqno
        self.model[vb] = {k: v for k, v in self.model[vb].items() if v.seqno <= seqno}
        self.high[vb] = seqno

    @rule()
    def purge(self) -> None:
        expected = sum(
            1
            for vb in range(VBS)
            for version in self.model[vb].values()
            if version.kind is not ItemKind.MUTATION and version.delete_time < self.now
        )
        assert self.store.purge_tombstones(self.now) == expected
        for vb in range(VBS):
            self.model[vb] = {
                k: v
                for k, v in self.model[vb].items()
                if v.kind is ItemKind.MUTATION or v.delete_time >= self.now
            }

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def seqno_index_matches_the_model(self) -> None:
        for vb in range(VBS):
            assert self.store.high_seqno(vb) == self.high[vb]
            expected = sorted(self.model[vb].items(), key=lambda kv: kv[1].seqno)
            for start in range(self.high[vb] + 1):
                got = self.store.items_since(vb, start)
                want = [(k, v.seqno, v.kind) for k, v in expected if v.seqno > start]
                assert [(it.key, it.by_seqno, it.kind) for it in got] == want
            every = self.store.items_since(vb, 0)
            seqnos = [it.by_seqno for it in every]
            assert seqnos == sorted(set(seqnos))
            assert len({it.key for it in every}) == len(every)
            for it in every:
                assert self.store.lookup(vb, it.key) == it
                if it.kind is ItemKind.MUTATION:
                    assert it.value == self.model[vb][it.key].value

    @invariant()
    def counts_match(self) -> None:
        stats = self.store.stats()
        tombstones = sum(
            1 for m in self.model for v in m.values() if v.kind is not ItemKind.MUTATION
        )
        assert stats.tombstones == tombstones
        assert stats.items == sum(len(m) for m in self.model) - tombstones

    @invariant()
    def failover_log_is_well_formed(self) -> None:
        for vb in range(VBS):
            log = self.store.failover_log(vb)
            assert 1 <= len(log) <= MAX_ENTRIES
            assert log[0][0] == self.store.uuid(vb)
            seqnos = [s for _, s in log]
            assert seqnos == sorted(seqnos, reverse=True)  # non-decreasing toward newest
            assert seqnos[0] <= self.high[vb]
            assert len({u for u, _ in log}) == len(log)

    @invariant()
    def rollback_decisions_follow_the_rule(self) -> None:
        for vb in range(VBS):
            log = self.store.failover_log(vb)
            high = self.high[vb]
            assert self.store.rollback_decision(vb, 0, 0xBAD, 0, 0) is None
            if all(u != 0xBAD for u, _ in log):
                assert self.store.rollback_decision(vb, 1, 0xBAD, 1, 1) == 0
            for index, (uuid, _) in enumerate(log):
                upper = high if index == 0 else log[index - 1][1]
                assert self.store.rollback_decision(vb, upper, uuid, upper, upper) is None
                # A snapshot reaching past ``upper``: back to its start or to upper.
                for snap_start in (max(0, upper - 1), upper):
                    got = self.store.rollback_decision(vb, upper + 1, uuid, snap_start, upper + 2)
                    assert got == snap_start
                    assert got == rollback_decision(
                        log, high, upper + 1, uuid, snap_start, upper + 2
                    )

    @invariant()
    def checkpoints_are_ordered(self) -> None:
        for vb in range(VBS):
            listing = self.store.checkpoints(vb)
            ids = [c.id for c in listing]
            assert ids == sorted(set(ids))
            assert listing[-1].open and not any(c.open for c in listing[:-1])
            for before, after in itertools.pairwise(listing):
                assert before.end_seqno < after.start_seqno
            for it in self.store.items_since(vb, 0):
                found = self.store.checkpoint_of(vb, it.by_seqno)
                if found is not None:
                    assert found.id == it.checkpoint_id
                    assert found.start_seqno <= it.by_seqno
                    assert found.open or it.by_seqno <= found.end_seqno


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
