"""STAT groups on the UPR port, with the names 3.0 orchestrators poll.

``vbucket-seqno [vb]`` (from the gateway's own log: uuid, high seqno, purge
seqno), ``upr``/``dcp`` (every consumer connection and stream),
``vbucket-takeover <vb> <name>`` (items left for that connection's stream)
and ``""`` (general).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.uprfront.server import UprFront

Pairs = list[tuple[str, str]]


class UnknownStatGroup(Exception):
    pass


def _vbuckets(front: UprFront, args: list[str]) -> list[int]:
    if not args:
        return sorted(front.logs.logs)
    try:
        vb = int(args[0])
    except ValueError:
        raise UnknownStatGroup(f"vbucket {args[0]!r} is not a number") from None
    if vb not in front.logs.logs:
        raise UnknownStatGroup(f"no vbucket {vb}")
    return [vb]


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
        out += [
            (f"vb_{vb}:uuid", str(v.failover.uuid)),
            (f"vb_{vb}:high_seqno", str(v.high_seqno)),
            (f"vb_{vb}:abs_high_seqno", str(v.high_seqno)),
            (f"vb_{vb}:last_persisted_seqno", str(v.high_seqno)),
            (f"vb_{vb}:purge_seqno", str(v.purge_seqno)),
        ]
    return out


def _upr(front: UprFront, _args: list[str]) -> Pairs:
    out: Pairs = []
    for connection in list(front.connections.values()):
        out.extend(connection.connection_stats())
    return out


def _takeover(front: UprFront, args: list[str]) -> Pairs:
    if len(args) != 2:
        raise UnknownStatGroup("usage: vbucket-takeover <vbucket> <stream name>")
    vb = _vbuckets(front, args[:1])[0]
    connection = front.connections.get(args[1])
    stream = connection.streams.get(vb) if connection is not None else None
    if stream is None:
        raise UnknownStatGroup(f"no stream named {args[1]!r} on vbucket {vb}")
    return list(stream.takeover_stats().items())


GROUPS = {
    "": _general,
    "vbucket-seqno": _vbucket_seqno,
    "upr": _upr,
    "dcp": _upr,
    "vbucket-takeover": _takeover,
}


def collect(front: UprFront, request: str) -> Pairs:
    name, *args = request.split() or [""]
    group = GROUPS.get(name)
    if group is None:
        raise UnknownStatGroup(f"unknown stat group {name!r}")
    return group(front, args)
