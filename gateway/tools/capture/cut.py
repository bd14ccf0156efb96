"""Two-sided capture: record a TAP view and a UPR view at once and stop both at one cut.

Theory of operation. On a live bucket two captures never stop at the same
moment, so their views differ by whatever changed in between. This module
runs a TAP capture and a UPR capture side by side and gives both one
consistent cut, per vbucket, in the one coordinate both protocols carry
with every change: the CAS. A vbucket's changes reach each side in the
order the source node made them, and the node's CAS grows with every
change of a vbucket (ep-engine's ``Item::nextCas``, the reference node's
hybrid clock), so "every change with a CAS at or below C" is the same set
of changes on both sides.

1. Both captures run (full backfill, then live changes); a ``SideWatch`` on
   each recorder tracks, per vbucket, the highest CAS recorded and whether a
   TAP backfill is still running (a 2.x backfill comes in any order).
2. The cut is taken once: when both sides finished their initial catch-up
   (``until_caught_up``: every TAP backfill closed, every UPR stream at the
   high seqno its endpoint had at start) or when asked to stop (a signal).
   Per vbucket it is the furthest CAS either side has recorded by then.
3. Both keep recording until each has reached the cut in every vbucket
   (bounded by ``cut_timeout``); then a ``Kind.CUT`` record per vbucket goes
   into each side's capture, and both stop.

``verify`` compares each vbucket up to its cut; a change past it that only
one side recorded is "in flight", counted and listed, never a failure.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import trio

from gateway.tools.capture.recorder import CaptureRecorder
from gateway.tools.capture.records import CaptureRecord, Kind, cut_record
from gateway.tools.capture.session import CaptureOptions, CaptureResult

DEFAULT_CUT_TIMEOUT = 120.0
REACHED = "cut reached"
_BACKFILL_START = int(Kind.BACKFILL_START)
_BACKFILL_END = int(Kind.BACKFILL_END)

Runner = Callable[..., Awaitable[CaptureResult]]


class SideWatch:
    """What one side has recorded so far, per vbucket (fed by the recorder's observer)."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.max_cas: dict[int, int] = {}
        self.max_seqno: dict[int, int] = {}
        self.backfilling: set[int] = set()
        self.backfilled: set[int] = set()
        self.recorder: CaptureRecorder | None = None
        self.changed = trio.Event()
        self.ended = False
        """The capture task returned (the server closed it) or failed."""

    def attach(self, recorder: CaptureRecorder) -> None:
        self.recorder = recorder
        recorder.observer = self.seen

    def seen(self, r: CaptureRecord) -> None:
        vb = r.vbucket
        if r.kind < 10:
            if r.cas > self.max_cas.get(vb, 0):
                self.max_cas[vb] = r.cas
            if r.by_seqno is not None and r.by_seqno > self.max_seqno.get(vb, 0):
                self.max_seqno[vb] = r.by_seqno
        elif r.kind == _BACKFILL_START:
            self.backfilling.add(vb)
        elif r.kind == _BACKFILL_END:
            self.backfilling.discard(vb)
            self.backfilled.add(vb)
        self.changed.set()

    def reached(self, vb: int, cas: int) -> bool:
        return vb not in self.backfilling and self.max_cas.get(vb, 0) >= cas


@dataclass
class TwoSidedResult:
    tap: CaptureResult
    upr: CaptureResult
    cut: dict[int, int] = field(default_factory=dict)
    """Per vbucket, the CAS of the cut (empty until it is taken)."""
    behind: dict[str, list[int]] = field(default_factory=dict)
    """Per side, the vbuckets it had not reached when the capture stopped."""
    stopped: str = "running"

    @property
    def complete(self) -> bool:
        """Both sides reached the cut in every vbucket and carry its CUT records."""
        return self.stopped == REACHED

    def summary(self) -> str:
        lines = [self.tap.summary(), self.upr.summary()]
        if not self.cut:
            lines.append(f"no cut taken: {self.stopped}")
        else:
            late = "; ".join(
                f"{s} behind in vbuckets {v[:10]}" for s, v in self.behind.items() if v
            )
            lines.append(
                f"cut over {len(self.cut)} vbuckets: {self.stopped}" + (f"; {late}" if late else "")
            )
        return "\n".join(lines)


async def _run_side(
    runner: Runner,
    options: CaptureOptions,
    watch: SideWatch,
    *,
    task_status: trio.TaskStatus[CaptureResult],
) -> None:
    try:
        await runner(options, task_status=task_status)
    finally:
        watch.ended = True
        watch.changed.set()


async def _until(
    watches: tuple[SideWatch, ...], done: Callable[[], bool], stop: trio.Event | None
) -> bool:
    """Wait until ``done()``; ``False`` if a side ended or ``stop`` was set first."""
    while not done():
        if any(w.ended for w in watches) or (stop is not None and stop.is_set()):
            return False
        for w in watches:
            w.changed = trio.Event()
        async with trio.open_nursery() as nursery:
            for event in [w.changed for w in watches] + ([stop] if stop is not None else []):
                nursery.start_soon(_wake_on, event, nursery.cancel_scope)
    return True


async def _wake_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def capture_both(
    tap: CaptureOptions,
    upr: CaptureOptions,
    *,
    until_caught_up: bool,
    stop: trio.Event,
    cut_timeout: float = DEFAULT_CUT_TIMEOUT,
    tap_runner: Runner | None = None,
    upr_runner: Runner | None = None,
    task_status: trio.TaskStatus[TwoSidedResult] = trio.TASK_STATUS_IGNORED,
) -> TwoSidedResult:
    """Capture both sides into ``tap.out`` and ``upr.out`` and stop them at one cut.

    The cut is taken after the initial catch-up (``until_caught_up``) or when
    ``stop`` is set, whichever comes first.
    """
    from gateway.tools.capture.tap_capture import capture_tap
    from gateway.tools.capture.upr_capture import capture_upr

    tap_watch, upr_watch = SideWatch("tap"), SideWatch("upr")
    watches = (tap_watch, upr_watch)
    tap = replace(tap, until_caught_up=False, on_recorder=tap_watch.attach)
    upr = replace(upr, until_caught_up=False, on_recorder=upr_watch.attach)
    async with trio.open_nursery() as nursery:
        tap_result = await nursery.start(_run_side, tap_runner or capture_tap, tap, tap_watch)
        upr_result = await nursery.start(_run_side, upr_runner or capture_upr, upr, upr_watch)
        result = TwoSidedResult(tap_result, upr_result)
        task_status.started(result)
        vbuckets = sorted(set(tap_result.vbuckets) | set(upr_result.vbuckets))
        if until_caught_up:
            start_high = upr_result.start_high_seqnos

            def caught_up() -> bool:
                return all(vb in tap_watch.backfilled for vb in tap_result.vbuckets) and all(
                    upr_watch.max_seqno.get(vb, 0) >= high for vb, high in start_high.items()
                )

            await _until(watches, caught_up, stop)
        else:
            await _until(watches, lambda: False, stop)
        if any(w.ended for w in watches):
            result.stopped = "a side ended before the cut"
        else:
            result.cut = {
                vb: max(tap_watch.max_cas.get(vb, 0), upr_watch.max_cas.get(vb, 0))
                for vb in vbuckets
            }
            cut = result.cut

            def reached() -> bool:
                return all(w.reached(vb, cas) for w in watches for vb, cas in cut.items())

            with trio.move_on_after(cut_timeout):
                ok = await _until(watches, reached, None)
                result.stopped = REACHED if ok else "a side ended before the cut"
            if result.stopped == "running":
                result.stopped = f"cut not reached within {cut_timeout:g} s"
            result.behind = {
                w.side: [vb for vb, cas in cut.items() if not w.reached(vb, cas)] for w in watches
            }
            now = time.time()
            for w in watches:
                if w.recorder is not None:
                    for vb, cas in cut.items():
                        w.recorder.record(
                            cut_record(vb, cas=cas, seqno=w.max_seqno.get(vb, 0), arrival=now)
                        )
        tap_result.stopped = upr_result.stopped = result.stopped
        for w, side in ((tap_watch, tap_result), (upr_watch, upr_result)):
            side.caught_up = {vb for vb, cas in result.cut.items() if w.reached(vb, cas)}
        nursery.cancel_scope.cancel()
    return result
