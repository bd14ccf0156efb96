"""STAT groups of the reference node, with the names 2.x/3.0 operators know.

``""`` (general), ``vbucket``, ``vbucket-seqno [vb]``, ``failovers [vb]``,
``checkpoint``, ``tap``, ``upr`` (alias ``dcp``), ``dcp-vbtakeover <vb>
<name>`` (alias ``upr-vbtakeover``), ``tap-vbtakeover <vb> <name>`` and our
older ``vbucket-takeover <vb> <name>`` (either kind of stream). Refusals
follow ``gateway.io.stat_replies``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from gateway.io.stat_replies import (
    TAP_TAKEOVER_GROUPS,
    UPR_TAKEOVER_GROUPS,
    Pairs,
    StatError,
    UnknownStatGroup,
    failover_pairs,
    seqno_pairs,
    takeover_arguments,
    vbucket_argument,
)

if TYPE_CHECKING:
    from gateway.node.server import Node

__all__ = ["StatError", "UnknownStatGroup", "collect"]


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
    """Every vbucket, or the one named (EINVAL, NOT_MY_VBUCKET as ep-engine
    v3.0.0 src/ep_engine.cc ``doSeqnoStats`` refuses). A dead vbucket still
    answers: a move's source is read after the move."""
    n_vbuckets = node.store.n_vbuckets
    if not args:
        return list(range(n_vbuckets))
    return [vbucket_argument(args[0], lambda vb: 0 <= vb < n_vbuckets)]


def _vbucket_states(node: Node, args: list[str]) -> Pairs:
    return [(f"vb_{vb}", node.store.state(vb).name.lower()) for vb in _vbuckets(node, args)]


def _vbucket_seqno(node: Node, args: list[str]) -> Pairs:
    out: Pairs = []
    for vb in _vbuckets(node, args):
        s = node.store.vbucket_stats(vb)
        out += seqno_pairs(vb, s.uuid, s.high_seqno, s.purge_seqno)
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


def _failovers(node: Node, args: list[str]) -> Pairs:
    out: Pairs = []
    for vb in _vbuckets(node, args):
        out += failover_pairs(vb, node.store.failover_log(vb))
    return out


def _takeover(group: str) -> Callable[[Node, list[str]], Pairs]:
    """``<group> <vb> <name>``: how much that connection's stream has still to send."""

    def collect(node: Node, args: list[str]) -> Pairs:
        vb_arg, name = takeover_arguments(group, args)
        vb = _vbuckets(node, [vb_arg])[0]
        found = node.upr.takeover_stats(vb, name) if group in UPR_TAKEOVER_GROUPS else None
        if found is None and group in TAP_TAKEOVER_GROUPS:
            found = node.tap.takeover_stats(vb, name)
        if found is None:
            raise StatError(f"no stream named {name!r} on vbucket {vb}")
        return list(found.items())

    return collect


GROUPS = {
    "": _general,
    "vbucket": _vbucket_states,
    "vbucket-seqno": _vbucket_seqno,
    "checkpoint": _checkpoint,
    "tap": _tap,
    "upr": _upr,
    "dcp": _upr,
    "failovers": _failovers,
    "dcp-vbtakeover": _takeover("dcp-vbtakeover"),
    "upr-vbtakeover": _takeover("upr-vbtakeover"),
    "tap-vbtakeover": _takeover("tap-vbtakeover"),
    "vbucket-takeover": _takeover("vbucket-takeover"),
}


def collect(node: Node, request: str) -> Pairs:
    """The pairs of one STAT request (group name, then its arguments)."""
    name, *args = request.split() or [""]
    group = GROUPS.get(name)
    if group is None:
        raise UnknownStatGroup(f"unknown stat group {name!r}")
    return group(node, args)
