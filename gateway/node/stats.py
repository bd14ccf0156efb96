"""STAT groups of the reference node, with the names 2.x/3.0 operators know.

``""`` (general), ``vbucket``, ``vbucket-seqno [vb]``, ``checkpoint``,
``tap``, ``upr`` (alias ``dcp``) and ``vbucket-takeover <vb> <name>``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from gateway.node.server import Node

Pairs = list[tuple[str, str]]


class UnknownStatGroup(Exception):
    pass


def _general(node: Node, _args: list[str]) -> Pairs:
    from gateway.node.server import VERSION

    totals = node.store.stats()
    return [
        ("pid", str(os.getpid())),
        ("uptime", str(int(trio.current_time() - node.started_at))),
        ("version", VERSION),
        ("curr_connections", str(node.connections)),
        ("curr_items", str(totals.items)),
        ("ep_num_vbuckets", str(totals.vbuckets)),
        ("ep_max_items", str(totals.max_items)),
        ("vb_active_num", str(totals.active)),
        ("vb_replica_num", str(totals.replica)),
        ("vb_pending_num", str(totals.pending)),
        ("vb_dead_num", str(totals.dead)),
        ("ep_tombstones", str(totals.tombstones)),
        ("mem_used", str(totals.memory_bytes)),
        ("ep_expiry_queue", str(totals.expiry_queue)),
    ]


def _vbuckets(node: Node, args: list[str]) -> list[int]:
    if not args:
        return list(range(node.store.n_vbuckets))
    try:
        vb = int(args[0])
    except ValueError:
        raise UnknownStatGroup(f"vbucket {args[0]!r} is not a number") from None
    if not 0 <= vb < node.store.n_vbuckets:
        raise UnknownStatGroup(f"no vbucket {vb}")
    return [vb]


def _vbucket_states(node: Node, args: list[str]) -> Pairs:
    return [(f"vb_{vb}", node.store.state(vb).name.lower()) for vb in _vbuckets(node, args)]


def _vbucket_seqno(node: Node, args: list[str]) -> Pairs:
    out: Pairs = []
    for vb in _vbuckets(node, args):
        s = node.store.vbucket_stats(vb)
        out += [
            (f"vb_{vb}:uuid", str(s.uuid)),
            (f"vb_{vb}:high_seqno", str(s.high_seqno)),
            (f"vb_{vb}:abs_high_seqno", str(s.high_seqno)),
            (f"vb_{vb}:last_persisted_seqno", str(s.high_seqno)),
            (f"vb_{vb}:purge_seqno", "0"),
            (f"vb_{vb}:last_persisted_snap_start", str(s.snapshot_start)),
            (f"vb_{vb}:last_persisted_snap_end", str(s.snapshot_end)),
        ]
    return out


def _checkpoint(node: Node, args: list[str]) -> Pairs:
    out: Pairs = []
    for vb in _vbuckets(node, args):
        s = node.store.vbucket_stats(vb)
        out += [
            (f"vb_{vb}:state", s.state.name.lower()),
            (f"vb_{vb}:open_checkpoint_id", str(s.open_checkpoint_id)),
            (f"vb_{vb}:last_closed_checkpoint_id", str(s.last_closed_checkpoint_id)),
            (f"vb_{vb}:num_checkpoints", str(s.checkpoints)),
            (f"vb_{vb}:num_checkpoint_items", str(s.items + s.tombstones)),
        ]
    return out


def _tap(node: Node, _args: list[str]) -> Pairs:
    return node.tap.stats()


def _upr(node: Node, _args: list[str]) -> Pairs:
    return node.upr.stats()


def _takeover(node: Node, args: list[str]) -> Pairs:
    if len(args) != 2:
        raise UnknownStatGroup("usage: vbucket-takeover <vbucket> <stream name>")
    vb = _vbuckets(node, args[:1])[0]
    found = node.upr.takeover_stats(vb, args[1]) or node.tap.takeover_stats(vb, args[1])
    if found is None:
        raise UnknownStatGroup(f"no stream named {args[1]!r} on vbucket {vb}")
    return list(found.items())


GROUPS = {
    "": _general,
    "vbucket": _vbucket_states,
    "vbucket-seqno": _vbucket_seqno,
    "checkpoint": _checkpoint,
    "tap": _tap,
    "upr": _upr,
    "dcp": _upr,
    "vbucket-takeover": _takeover,
}


def collect(node: Node, request: str) -> Pairs:
    """The pairs of one STAT request (group name, then its arguments)."""
    name, *args = request.split() or [""]
    group = GROUPS.get(name)
    if group is None:
        raise UnknownStatGroup(f"unknown stat group {name!r}")
    return group(node, args)
