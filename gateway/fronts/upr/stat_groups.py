"""STAT groups on the UPR port, with the names 3.0 orchestrators poll.

``vbucket`` (each vbucket's state here: active, or dead once taken over),
``vbucket-seqno [vb]`` (from the gateway's own log: uuid, high seqno, purge
seqno), ``failovers [vb]`` (the gateway's own failover logs),
``upr``/``dcp`` (the ``ep_dcp_*`` totals, then every consumer connection
and stream), ``dcp-vbtakeover <vb> <name>`` (aliases ``upr-vbtakeover``,
``vbucket-takeover``: items left for that connection's stream) and ``""``
(general). Refusals follow ``gateway.io.stat_replies``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from gateway.io.stat_replies import (
    UPR_TAKEOVER_GROUPS,
    Pairs,
    StatError,
    UnknownStatGroup,
    dcp_group,
    failover_pairs,
    seqno_pairs,
    takeover_arguments,
    vbucket_argument,
)

if TYPE_CHECKING:
    from gateway.fronts.upr.server import UprFront

__all__ = ["StatError", "UnknownStatGroup", "collect"]


def _vbuckets(front: UprFront, args: list[str]) -> list[int]:
    """Every vbucket of the log, or the one named (one taken over still answers)."""
    if not args:
        return sorted(front.logs.logs)
    return [vbucket_argument(args[0], front.logs.logs.__contains__)]


def _vbucket_states(front: UprFront, args: list[str]) -> Pairs:
    return [(f"vb_{vb}", "active" if front.serves(vb) else "dead") for vb in _vbuckets(front, args)]


def _failovers(front: UprFront, args: list[str]) -> Pairs:
    out: Pairs = []
    for vb in _vbuckets(front, args):
        out += failover_pairs(vb, front.logs.logs[vb].failover.entries)
    return out


def _general(front: UprFront, _args: list[str]) -> Pairs:
    ingest = front.ingest
    return [
        ("pid", str(os.getpid())),
        ("upr_front_connections", str(len(front.connections))),
        ("upr_front_vbuckets", str(len(front.logs.logs))),
        ("upstream", ingest.address),
        ("upstream_connections", str(ingest.connections)),
        ("upstream_messages", str(ingest.messages)),
        ("upstream_last_error", ingest.last_error or ""),
    ]


def _vbucket_seqno(front: UprFront, args: list[str]) -> Pairs:
    out: Pairs = []
    for vb in _vbuckets(front, args):
        v = front.logs.logs[vb]
        out += seqno_pairs(vb, v.failover.uuid, v.high_seqno, v.purge_seqno)
    return out


def _upr(front: UprFront, _args: list[str]) -> Pairs:
    """The totals always come, with no consumer attached too (as the node's)."""
    connections = sorted(front.connections.values(), key=lambda c: c.name)
    streams = [s for c in connections for s in c.streams.values()]
    totals = [
        ("count", len(connections)),
        ("producer_count", len(connections)),
        ("consumer_count", 0),
        ("total_bytes", sum(c.stream_stats.bytes_sent for c in connections)),
        ("items_sent", sum(s.items_sent for s in streams)),
        ("items_remaining", sum(s.items_remaining() for s in streams)),
    ]
    per_connection: Pairs = []
    for connection in connections:
        per_connection.extend(connection.connection_stats())
    return dcp_group(totals, per_connection)


def _takeover(front: UprFront, args: list[str]) -> Pairs:
    vb_arg, name = takeover_arguments("dcp-vbtakeover", args)
    vb = _vbuckets(front, [vb_arg])[0]
    connection = front.connections.get(name)
    stream = connection.streams.get(vb) if connection is not None else None
    if stream is None:
        raise StatError(f"no stream named {name!r} on vbucket {vb}")
    return list(stream.takeover_stats().items())


GROUPS = {
    "": _general,
    "vbucket": _vbucket_states,
    "vbucket-seqno": _vbucket_seqno,
    "failovers": _failovers,
    "upr": _upr,
    "dcp": _upr,
    **dict.fromkeys(UPR_TAKEOVER_GROUPS, _takeover),
}


def collect(front: UprFront, request: str) -> Pairs:
    name, *args = request.split() or [""]
    group = GROUPS.get(name)
    if group is None:
        raise UnknownStatGroup(f"unknown stat group {name!r}")
    return group(front, args)
