"""The order of a producer's STREAM_REQ checks, as ep-engine 3.0
src/upr-producer.cc ``UprProducer::streamRequest`` runs them: no such
vbucket (NOT_MY_VBUCKET), then start > end and a start outside the snapshot
(ERANGE), then a live stream on the vbucket (KEY_EEXISTS), then the rollback
rule. So a bad range is ERANGE even where a stream exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adapters import upr
from adapters.mcbp import FrameReader, Status
from adapters.upr import producer_machine as pm
from adapters.upr.producer_machine import ProducerMachine


@dataclass
class FakeStream:
    opaque: int
    live: bool = True


def status(outputs: tuple[pm.Output, ...]) -> int:
    reader = FrameReader()
    for output in outputs:
        assert isinstance(output, pm.Reply)
        reader.receive_data(output.data)
    (frame,) = reader.frames()
    return frame.vbucket_or_status


def streaming(dialect: upr.Dialect = upr.DCP) -> ProducerMachine[FakeStream]:
    m: ProducerMachine[FakeStream] = ProducerMachine(
        "c", dialect, noop_interval=10.0, serves=lambda vb: vb < 4
    )
    m.add_stream(1, FakeStream(opaque=1))
    return m


@pytest.mark.parametrize(
    ("start", "end", "snap", "flags", "expected"),
    [
        (5, 3, (5, 5), 0, Status.RANGE_ERROR),
        (5, 9, (6, 7), 0, Status.RANGE_ERROR),
        (5, 9, (5, 7), 0, Status.KEY_EXISTS),
        # LATEST / DISKONLY: the end is the vbucket's, known to the role only.
        (5, 3, (5, 5), upr.StreamFlags.LATEST, Status.KEY_EXISTS),
        # ... but the snapshot check does not need it: ERANGE still comes first.
        (5, 9, (6, 7), upr.StreamFlags.LATEST, Status.RANGE_ERROR),
        (5, 9, (6, 7), upr.StreamFlags.DISK_ONLY, Status.RANGE_ERROR),
    ],
)
def test_a_bad_range_comes_before_an_existing_stream(
    start: int, end: int, snap: tuple[int, int], flags: int, expected: Status
) -> None:
    req = upr.StreamRequest(
        flags=upr.StreamFlags(flags),
        start_seqno=start,
        end_seqno=end,
        snap_start_seqno=snap[0],
        snap_end_seqno=snap[1],
        opaque=9,
        vbucket=1,
    )
    assert status(streaming().receive(req, 0.0)) == expected


def test_not_my_vbucket_comes_first() -> None:
    req = upr.StreamRequest(start_seqno=5, end_seqno=3, opaque=9, vbucket=7)
    assert status(streaming().receive(req, 0.0)) == Status.NOT_MY_VBUCKET


def test_the_draft_has_no_snapshot_to_check() -> None:
    req = upr.StreamRequest(start_seqno=5, end_seqno=9, opaque=9, vbucket=1)
    assert status(streaming(upr.UPR_DRAFT).receive(req, 0.0)) == Status.KEY_EXISTS
