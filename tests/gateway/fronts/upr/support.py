"""Helpers of the UPR front's tests: a reference node upstream, the gateway, checks."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import trio

from adapters import upr
from gateway.node.items import StoreError
from gateway.node.store import Store
from tests.support.fronts import (
    FrontScope,
    caught_up,
    store_state,
    upr_front_over_node,
)
from tests.support.fronts import open_consumer as open_producer
from tests.support.fronts import start_upr_front as start_front
from tests.support.fronts import upr_front_config as config
from tests.support.tap_client import start_node
from tests.support.upr_client import MAX_SEQNO, StreamLog, UprClient, until

VBUCKETS = 4

__all__ = [
    "MAX_SEQNO",
    "VBUCKETS",
    "FrontScope",
    "StreamLog",
    "UprClient",
    "caught_up",
    "config",
    "filled_store",
    "final_state",
    "open_producer",
    "start_front",
    "start_node",
    "store_state",
    "until",
    "upr_front_over_node",
    "write_load",
]


def filled_store(n: int = 40, **kwargs: Any) -> Store:
    """Writes, overwrites, deletes and soon-to-expire items in every vbucket."""
    store = Store(VBUCKETS, **kwargs)
    now = time.time()
    for vb in range(VBUCKETS):
        for i in range(n):
            store.set(vb, b"key-%d" % i, b"value-%d-%d" % (vb, i), flags=i, now=now)
        for i in range(0, n, 3):
            store.set(vb, b"key-%d" % i, b"again-%d" % i, now=now)
        for i in range(0, n, 7):
            store.delete(vb, b"key-%d" % i, now=now)
    return store


def final_state(log: StreamLog) -> dict[bytes, tuple[int, bytes | None]]:
    out: dict[bytes, tuple[int, bytes | None]] = {}
    for e in log.items:
        out[e.key] = (e.cas, e.value if isinstance(e, upr.Mutation) else None)
    return out


async def write_load(store: Store, n: int, *, seed: int = 1, pause_every: int = 50) -> None:
    """Concurrent writes on the node: sets, overwrites and deletes across vbuckets."""
    import random

    rng = random.Random(seed)
    for i in range(n):
        vb = rng.randrange(VBUCKETS)
        key = b"load-%d" % rng.randrange(60)
        now = time.time()
        if rng.random() < 0.2:
            with contextlib.suppress(StoreError):  # not there: nothing to delete
                store.delete(vb, key, now=now)
        else:
            with contextlib.suppress(StoreError):  # a vbucket taken over: refused
                store.set(vb, key, b"v%d" % i, now=now)
        if i % pause_every == 0:
            await trio.sleep(0.001)
