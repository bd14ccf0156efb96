"""STREAM_REQ checks the first pass left open, as ep-engine 3.0
src/upr-producer.cc ``UprProducer::streamRequest`` runs them:

- LATEST (0x04) and DISKONLY (0x02) set the end seqno to the vbucket's high
  seqno (DISKONLY: the last persisted one) before the range checks, and those
  come before the live-stream check: a start past the high seqno is ERANGE
  even on a vbucket that already streams, not KEY_EEXISTS;
- a notifier connection (``notifyOnly``) has no range checks: only KEY_EEXISTS
  for a live stream, then the rollback rule with a start of at most the high
  seqno (``min(start, high)``, so a start past the high seqno is no reason to
  roll back).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import FrameReader, Status
from adapters.upr import producer_machine as pm
from adapters.upr.producer_machine import ProducerMachine
from adapters.upr.rollback import answer_stream_request

HIGH = 20
UUID = 0xAA
LOG = [(UUID, 0)]
MAX_SEQNO = 0xFFFFFFFFFFFFFFFF


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


def streaming(*, notifier: bool = False) -> ProducerMachine[FakeStream]:
    m: ProducerMachine[FakeStream] = ProducerMachine(
        "c",
        upr.DCP,
        noop_interval=10.0,
        serves=lambda vb: vb < 4,
        notifier=notifier,
        high_seqno=lambda _vb: HIGH,
    )
    m.add_stream(1, FakeStream(opaque=1))
    return m


def request(
    start: int, end: int, snap: tuple[int, int], flags: int = 0, vb: int = 1
) -> upr.StreamRequest:
    return upr.StreamRequest(
        flags=upr.StreamFlags(flags),
        start_seqno=start,
        end_seqno=end,
        vbucket_uuid=UUID,
        snap_start_seqno=snap[0],
        snap_end_seqno=snap[1],
        opaque=9,
        vbucket=vb,
    )


@pytest.mark.parametrize("flag", [upr.StreamFlags.LATEST, upr.StreamFlags.DISK_ONLY])
@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (HIGH + 1, MAX_SEQNO, Status.RANGE_ERROR),
        (HIGH + 1, 3, Status.RANGE_ERROR),
        (HIGH, 3, Status.KEY_EXISTS),  # the end sent is replaced: HIGH, and start <= end
        (5, 3, Status.KEY_EXISTS),
    ],
)
def test_latest_on_a_streaming_vbucket_checks_the_high_seqno_first(
    flag: upr.StreamFlags, start: int, end: int, expected: Status
) -> None:
    req = request(start, end, (start, start), flag)
    assert status(streaming().receive(req, 0.0)) == expected


@given(
    start=st.integers(0, 100),
    end=st.integers(0, 100),
    snap=st.tuples(st.integers(0, 100), st.integers(0, 100)),
    flags=st.sampled_from([0, upr.StreamFlags.LATEST, upr.StreamFlags.TAKEOVER]),
)
def test_a_notifier_streaming_a_vbucket_is_key_exists_whatever_the_range(
    start: int, end: int, snap: tuple[int, int], flags: int
) -> None:
    req = request(start, end, snap, flags)
    assert status(streaming(notifier=True).receive(req, 0.0)) == Status.KEY_EXISTS


def test_a_notifier_request_on_a_free_vbucket_goes_to_the_role() -> None:
    req = request(HIGH + 50, 3, (0, 0), vb=2)
    (wanted,) = streaming(notifier=True).receive(req, 0.0)
    assert wanted == pm.StreamWanted(req)


@pytest.mark.parametrize(
    ("start", "end", "snap"),
    [
        (HIGH + 50, 3, (0, 0)),  # past the end and outside its snapshot
        (HIGH, HIGH, (HIGH, HIGH)),
        (5, 3, (0, 4)),
    ],
)
def test_a_notifier_has_no_range_checks(start: int, end: int, snap: tuple[int, int]) -> None:
    answer = answer_stream_request(request(start, end, snap), LOG, HIGH, notifier=True)
    assert answer == upr.StreamRequestOk(tuple(LOG), 9)


@pytest.mark.parametrize(("start", "end", "snap"), [(HIGH + 50, 3, (0, 0)), (5, 3, (0, 4))])
def test_the_same_requests_from_a_producer_are_range_errors(
    start: int, end: int, snap: tuple[int, int]
) -> None:
    answer = answer_stream_request(request(start, end, snap), LOG, HIGH)
    assert isinstance(answer, upr.Response) and answer.status == Status.RANGE_ERROR


def test_a_notifier_with_an_unknown_uuid_still_rolls_back() -> None:
    req = upr.StreamRequest(
        start_seqno=5, end_seqno=9, vbucket_uuid=0xBAD, snap_start_seqno=5, snap_end_seqno=5
    )
    answer = answer_stream_request(req, LOG, HIGH, notifier=True)
    assert answer == upr.StreamRequestRollback(0, req.opaque)
