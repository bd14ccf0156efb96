"""Whether an fsync that returned 0 proves anything: the fsyncs of one file, in flight and failed.

Linux reports a failed writeback once per open file (``errseq``, since
4.13): when two fsyncs of one file overlap, the one that looks first gets
EIO and the other returns 0, although the pages it was to make durable are
gone (no longer dirty, never written). So an fsync's 0 proves its bytes only
if no fsync of the file that overlapped it failed, and only once what a
failure dropped is written again. ``FsyncEpoch`` answers that for the
active segment file of one vbucket log:

- ``begin`` before an fsync (on the trio thread), ``failed`` from the worker
  thread when it raises (before the thread returns), ``end`` once it is back
  on the trio thread. ``overlapped_failure(since)`` waits until every fsync
  of the file in flight has returned and says whether one failed since
  ``begin`` returned ``since``: a superset of the overlapping ones (a later
  failure makes the caller write again, never lose).
- ``handled`` is called by whoever takes a failure back (``VbLog.unwrite``);
  until then ``unhandled`` holds and no 0 is trusted.
- A committer cancelled between its fsync's failure and the take-back
  ``orphan``s it: the next write of the log writes everything not settled
  again at the same offsets and counts the failure handled
  (``VbLog.write``), so the fsync after it can prove the file again; left
  alone, every later fsync of the file would stay untrusted until one failed.
"""

from __future__ import annotations

import trio


class FsyncEpoch:
    """The fsyncs of one file (see the module)."""

    __slots__ = ("failures", "handled_failures", "in_flight", "orphaned", "returned")

    def __init__(self) -> None:
        self.in_flight = 0
        """fsyncs of the file in flight (no segment roll until they return)."""
        self.failures = 0
        """fsyncs of it that failed (counted in the worker thread)."""
        self.handled_failures = 0
        """Of those, the ones taken back (written again, or due to be)."""
        self.orphaned = False
        """A failure whose committer was cancelled before taking it back."""
        self.returned = trio.Event()
        """Set, and replaced, whenever an fsync of the file returns to the loop."""

    def begin(self) -> int:
        """An fsync of the file is about to start; what ``overlapped_failure`` takes."""
        self.in_flight += 1
        return self.failures

    def failed(self) -> None:
        """From the worker thread: the fsync raised (before the thread returns)."""
        self.failures += 1

    def end(self) -> None:
        """The fsync returned to the trio thread (failed or not)."""
        self.in_flight -= 1
        self.returned.set()
        self.returned = trio.Event()

    @property
    def unhandled(self) -> bool:
        """A failure not taken back yet: an fsync returning 0 now proves nothing."""
        return self.handled_failures != self.failures

    def handled(self) -> None:
        """Every failure so far is taken back."""
        self.handled_failures = self.failures
        self.orphaned = False

    def orphan(self) -> None:
        """A failure's committer gave up (cancelled) before taking it back."""
        self.orphaned = True

    async def overlapped_failure(self, since: int) -> bool:
        """Once no fsync of the file is in flight: whether one failed since ``begin``
        returned ``since``, or a failure is still not taken back."""
        while self.in_flight:
            await self.returned.wait()
        return self.failures != since or self.unhandled
