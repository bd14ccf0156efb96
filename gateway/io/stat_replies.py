"""STAT answers the node and the fronts build alike, named and refused as 3.0 did.

The reference node and both fronts answer the same STAT groups for the
tools of the 2.x/3.0 era; what they share lives here so they cannot drift:

- the errors: an unknown group is KEY_NOT_FOUND; a vbucket argument that is
  not a number is EINVAL (0x04) and one the server does not have
  NOT_MY_VBUCKET (0x07), as ep-engine v3.0.0 src/ep_engine.cc
  ``doSeqnoStats`` answers ``vbucket-seqno <vb>`` (``getVBucket`` checks no
  state: a dead vbucket answers, as a replica or pending one does);
- ``vbucket-seqno [vb]``: ``high_seqno``, ``uuid`` and ``purge_seqno`` per
  vbucket and nothing else, for every vbucket the server has whatever its
  state, as ``doSeqnoStats`` gave them (later servers'
  ``abs_high_seqno`` breaks couchbase-cli 3.0 pump_upr.py, which takes any
  key holding ``high_seqno`` for a vbucket's);
- ``failovers [vb]``: ``vb_N:num_entries`` then ``vb_N:M:id`` and
  ``vb_N:M:seq``, newest entry first (src/failover-table.cc
  ``FailoverTable::addStats``);
- the takeover groups' names: ``dcp-vbtakeover``/``upr-vbtakeover`` (3.0)
  and ``tap-vbtakeover`` (2.5.1), each ``<vb> <connection name>``, with
  our older ``vbucket-takeover`` kept as an alias;
- the ``ep_dcp_*`` totals of ``STAT dcp``, with their pre-release
  ``ep_upr_*`` spellings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from adapters.mcbp import Status

Pairs = list[tuple[str, str]]

UPR_TAKEOVER_GROUPS = frozenset({"dcp-vbtakeover", "upr-vbtakeover", "vbucket-takeover"})
TAP_TAKEOVER_GROUPS = frozenset({"tap-vbtakeover", "vbucket-takeover"})


class StatError(Exception):
    """A STAT request refused with ``status``; the text says why."""

    status: int = Status.KEY_NOT_FOUND

    def __init__(self, text: str, status: int | None = None) -> None:
        super().__init__(text)
        if status is not None:
            self.status = status


class UnknownStatGroup(StatError):
    status = Status.KEY_NOT_FOUND


def vbucket_argument(arg: str, served: Callable[[int], bool]) -> int:
    """The vbucket a STAT argument names: EINVAL if not a number, NOT_MY_VBUCKET
    if ``served`` says it is not here."""
    if not arg.isdigit():
        raise StatError(f"vbucket {arg!r} is not a number", Status.INVALID_ARGUMENTS)
    vb = int(arg)
    if not served(vb):
        raise StatError(f"no vbucket {vb} here", Status.NOT_MY_VBUCKET)
    return vb


def takeover_arguments(group: str, args: Sequence[str]) -> tuple[str, str]:
    """``<vb> <name>`` of a takeover group (the vbucket still to be checked)."""
    if len(args) != 2:
        raise StatError(f"usage: {group} <vbucket> <connection name>", Status.INVALID_ARGUMENTS)
    return args[0], args[1]


def seqno_pairs(vb: int, uuid: int, high_seqno: int, purge_seqno: int) -> Pairs:
    """One vbucket's ``vbucket-seqno`` answer, the 3.0.0 keys in their order."""
    return [
        (f"vb_{vb}:high_seqno", str(high_seqno)),
        (f"vb_{vb}:uuid", str(uuid)),
        (f"vb_{vb}:purge_seqno", str(purge_seqno)),
    ]


def failover_pairs(vb: int, entries: Sequence[tuple[int, int]]) -> Pairs:
    """One vbucket's failover log as ``STAT failovers`` gives it, newest first."""
    out = [(f"vb_{vb}:num_entries", str(len(entries)))]
    for i, (uuid, seqno) in enumerate(entries):
        out += [(f"vb_{vb}:{i}:id", str(uuid)), (f"vb_{vb}:{i}:seq", str(seqno))]
    return out


def dcp_totals(totals: Iterable[tuple[str, int]]) -> tuple[Pairs, Pairs]:
    """(``ep_dcp_*`` pairs, their ``ep_upr_*`` aliases) of ``STAT dcp``."""
    listed = list(totals)
    return (
        [(f"ep_dcp_{name}", str(value)) for name, value in listed],
        [(f"ep_upr_{name}", str(value)) for name, value in listed],
    )


def dcp_group(totals: Iterable[tuple[str, int]], per_connection: Pairs) -> Pairs:
    """``STAT dcp``: totals, ``eq_dcpq:<name>:<stat>``, then the pre-release spellings.

    ``per_connection`` names are ``<name>:<stat>``, without the prefix.
    """
    current, old = dcp_totals(totals)
    return (
        current
        + [(f"eq_dcpq:{key}", value) for key, value in per_connection]
        + old
        + [(f"eq_uprq:{key}", value) for key, value in per_connection]
    )
