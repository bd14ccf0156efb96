"""Making the UPR front's log durable: write, publish, fsync off the trio loop, then ack.

Theory of operation. ``commit`` takes a set of vbucket logs: it writes each
one's buffered records to its segment file, fsyncs them (``sync_logs``: one
hand-off to a worker thread, which fsyncs several files at once so the file
system groups them into one journal commit), and publishes them to readers.
With fsync "batch" it publishes right after the write, before the fsync
returns, as ep-engine 3.0 streams items from its checkpoints before the
flusher persists them (``src/upr-stream.cc``, ``ActiveStream::inMemoryPhase``):
live consumers do not wait for the disk. The TAP acks still leave only after
the fsync, so nothing the TAP node considers delivered is ever lost; what a
crash takes back was served but never acked, and a log not closed cleanly
opens with a new failover entry at its proven end (see ``vblog``), so a
consumer that saw more rolls back. Fsync "always", a takeover connection and
a vbucket being handed over publish only what is synced.

``GroupCommit`` pipelines commits with the ingest's reading: the ingest
applies each socket read's frames to the logs' buffers and ``submit``s the
logs it touched with the acks and replies owed for them; one task commits
everything submitted before it started, sends those acks upstream in one
write, and starts again with whatever arrived meanwhile. With fsync "batch"
each submission's records are written and published at once
(``VbLog.write_early``), not when their commit starts: a live item reaches
consumers without waiting for the fsync of the commit before, and commits
start at most every ``EARLY_COMMIT_INTERVAL``, or ``COMMIT_SPACING_PER_FILE``
per file to fsync when that is longer (a commit's CPU grows with its files) and
between ``QUIET_BYTES`` and ``SPACED_BYTES`` were read meanwhile
(``BUSY_SPACING_PER_FILE`` from ``BUSY_BYTES``). So
while one
commit's fsyncs run the next batch accumulates, a commit covers all that
arrived before it, each file is fsynced once per commit however many items
it got, and acks leave in order, each only after the fsync of every record
before it (a TAP ack acknowledges everything up to its sequence number).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import trio

from gateway.fronts.upr.vblog import LogWriteError, VbLog

SYNC_THREADS = 16
"""Threads a commit fsyncs its logs in at once at most: the file system groups
concurrent fsyncs into one journal commit (64 segment files: about 7 ms in
16 threads against 86 ms one after the other on this machine's ext4)."""
PER_THREAD = 2
"""Files each of those threads fsyncs, one after the other (measured here: two
per thread cost less CPU than one, and wait no longer than four)."""
EARLY_COMMIT_INTERVAL = 0.005
"""Seconds between the starts of two commits at least when records are published
before their fsync (fsync batch): consumers do not wait for commits then, only the
TAP acks do, and at low rates each fsync covers several items instead of one (an
fsync and its hand-offs cost about 100-250 µs of CPU here)."""
COMMIT_SPACING_PER_FILE = 0.0005
"""Seconds between the starts of two such commits at least, per file the next one
fsyncs: a commit costs 50-100 µs of CPU per file here (its fsync, the thread
hand-offs and settling: 3.4 ms for 64 files on a quiet machine, two thirds of it
in the kernel), so a live stream touching 64 vbuckets, committed as soon as the
last commit returned, spent about half a core on commits alone. Spaced so, they
take about a tenth of a core whatever the number of files; only the TAP acks
wait longer (32 ms for 64 files), consumers never do. ``SPACED_BYTES`` bounds
the wait."""
BUSY_SPACING_PER_FILE = 0.001
"""The spacing per file once ``BUSY_BYTES`` were read since the last commit began:
a fast stream's commits cost more on a busy machine (each fsync's return takes the
GIL from the loop's thread), and at 20k one-item checkpoints a second over 64
vbuckets, half as many commits took 4-8 µs of CPU off each item (64 ms for 64
files; the TAP acks still leave well inside a 2.x producer's window, see
``SPACED_BYTES``). A slower stream keeps ``COMMIT_SPACING_PER_FILE``: its commits
are cheap, and bunching its fsyncs holds the loop (``QUIET_BYTES``)."""
BUSY_BYTES = 64 * 1024
"""Bytes read since the last commit began from which ``BUSY_SPACING_PER_FILE`` applies
(about 13 ms of the live bench's 20k items a second, 110 ms of 2k)."""
SPACED_BYTES = 512 * 1024
"""Bytes read since the last commit began beyond which the next one waits only
``EARLY_COMMIT_INTERVAL``: a 2.x producer stops sending at 10,000 messages not
acknowledged (``tap_ack_window_size`` x ``tap_ack_interval``, ep-engine 2.x
src/tapconnection.cc ``TapProducer::windowIsFull``), about 1.5 MB of 100-byte
items, so a fast stream is acked long before the window fills."""
QUIET_BYTES = 8 * 1024
"""Bytes read since the last commit began below which the next one waits only
``EARLY_COMMIT_INTERVAL`` however many files it covers: a slow stream's commits
are cheap, and spacing them by files would only bunch its fsyncs into bursts
that hold the loop while consumers wait (at 2k items/s over 64 vbuckets the
added p99 went from about 1 ms to about 3 ms). 8 KiB in the 5 ms interval is
about 1.6 MB/s: some 6k items/s of the live bench's worst case (three TAP
messages per 100-byte item)."""
MAX_PENDING_BYTES = 16 * 1024 * 1024
"""Bytes the ingest may read beyond the commit in progress before it waits for it."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(SYNC_THREADS - 1, thread_name_prefix="log-fsync")
        return _pool


async def commit(logs: dict[int, VbLog], *, sync: bool, early: bool = False) -> int:
    """Write, fsync (``sync``, off the trio loop) and publish ``logs``; bytes written.

    ``early`` (fsync batch): publish right after the write, before the fsync
    returns (readers get the page cache's copy), and hold no lock during the
    fsync, so the ingest keeps publishing (``VbLog.write_early``); the caller
    still acks only after this returns, so nothing acknowledged is lost.
    Otherwise publish only what is synced, each log's lock held from its write
    to its publish, taken in vbucket order (two committers never wait on each
    other crosswise): a takeover connection writing the same vbucket as the
    ingest cannot publish records the other wrote but has not yet synced. A
    log being handed over (``VbLog.handing_over``) is committed that way even
    when ``early``, its lock held to its publish, the others' released before
    the fsync. A log whose write or fsync fails keeps what it published (written again
    with the same seqnos by the next commit) and takes back what it did not
    (see ``VbLog.unwrite``); the others are published, then the first failure
    is raised, so the caller acks nothing of the batch.
    """
    ordered = [logs[vb] for vb in sorted(logs)]
    failure: LogWriteError | None = None
    written = 0
    good: list[VbLog] = []
    locked: list[VbLog] = []
    # Early, with no log locked or handed over (the usual case), the locks would be
    # taken and given back with no checkpoint between: nobody could see them held.
    plain = early and not any(v.handing_over or v.lock.locked() for v in ordered)
    try:
        for vblog in () if plain else ordered:
            # Uncontended (the usual case) without a trip through the scheduler each.
            try:
                vblog.lock.acquire_nowait()
            except trio.WouldBlock:
                await vblog.lock.acquire()
            locked.append(vblog)
        # Decided with the locks held: a log being handed over publishes only synced
        # records whoever commits it (``VbLog.handing_over``), its lock kept to its publish.
        apart = frozenset(v.vbucket for v in ordered if early and v.handing_over)
        for vblog in ordered:
            try:
                written += vblog.write()
                if (early and vblog.vbucket not in apart) or not sync:
                    vblog.publish(settle=not sync)
            except LogWriteError as exc:
                failure = failure or exc
                continue
            good.append(vblog)
        if not sync:
            good = []
        if early:
            for vblog in [v for v in locked if v.vbucket not in apart]:
                locked.remove(vblog)
                vblog.lock.release()
        if good:
            failure = await _sync_and_settle(good, early, apart) or failure
    finally:
        for vblog in locked:
            vblog.lock.release()
    if failure is not None:
        raise failure
    return written


async def _sync_and_settle(
    logs: list[VbLog], early: bool, apart: frozenset[int] = frozenset()
) -> LogWriteError | None:
    """fsync ``logs`` up to what each has written now, then publish (unless published
    already: ``early``, but for the vbuckets ``apart``, whose locks are still held)
    and settle them; the first failure."""
    failure: LogWriteError | None = None
    due = [(v, v.fsyncs, v.written_size, v.fsyncs.begin()) for v in logs]
    try:
        failed = await sync_logs(logs)
    finally:
        for _vblog, epoch, _upto, _since in due:
            epoch.end()
    taken_back = 0
    try:
        for vblog, fsync_error in failed:
            if early and vblog.vbucket not in apart:
                # Not while a committer that publishes only synced records is between
                # its write and its publish: it would find its fsynced bytes cut back.
                await vblog.lock.acquire()
                try:
                    error = vblog.unwrite(fsync_error)
                finally:
                    vblog.lock.release()
            else:
                error = vblog.unwrite(fsync_error)
            taken_back += 1
            failure = failure or error
    finally:
        # Cancelled before taking a failure back: the log's next write does (see
        # ``fsync_epoch``), or every later fsync of the file would stay in doubt.
        for vblog, _error in failed[taken_back:]:
            vblog.fsyncs.orphan()
    for vblog, epoch, upto, since in due:
        if any(vblog is f for f, _ in failed):
            continue
        # Linux tells a failed writeback to one fsync of the file only: once every fsync
        # of it that overlapped this one has returned, a failure among them (or one not
        # yet taken back) means this 0 proves nothing. Settle nothing, ack nothing.
        if await epoch.overlapped_failure(since) or vblog.sync_in_doubt:
            path = vblog.segments[-1].path
            failure = failure or LogWriteError(
                f"vbucket {vblog.vbucket}: an fsync of {path.parent.name}/{path.name} "
                "overlapped one that failed; nothing acknowledged, written again"
            )
            continue
        try:
            if not early or vblog.vbucket in apart:
                vblog.publish(settle=False)
            vblog.settle(upto)
        except LogWriteError as exc:
            failure = failure or exc
    return failure


async def sync_logs(logs: list[VbLog]) -> list[tuple[VbLog, OSError]]:
    """fsync every log that has unsynced writes; the ones that failed, with their
    error. One hand-off to a worker thread, whatever the number of files."""
    due = [v for v in logs if v.unsynced]
    if not due:
        return []
    return await trio.to_thread.run_sync(_sync_grouped, due)


def _sync_grouped(logs: list[VbLog]) -> list[tuple[VbLog, OSError]]:
    """In a worker thread: fsync ``logs``, ``PER_THREAD`` per thread at once."""
    threads = min(SYNC_THREADS, -(-len(logs) // PER_THREAD))
    if threads <= 1:
        return _sync_all(logs)
    groups = [logs[n::threads] for n in range(threads)]
    pool = _executor()
    futures = [pool.submit(_sync_all, group) for group in groups[1:]]
    failed = _sync_all(groups[0])
    for future in futures:
        failed += future.result()
    return failed


def _sync_all(logs: list[VbLog]) -> list[tuple[VbLog, OSError]]:
    """fsync each log; the ones that failed, with their error."""
    failed = []
    for vblog in logs:
        try:
            vblog.sync()
        except OSError as exc:
            vblog.fsyncs.failed()  # before this thread returns (see _sync_and_settle)
            failed.append((vblog, exc))
    return failed


CommitLogs = Callable[[dict[int, VbLog]], Awaitable[None]]
Send = Callable[[bytes], Awaitable[None]]


class GroupCommit:
    """Commits what the ingest submits, one commit at a time, each covering everything
    submitted before it started; sends each commit's acks after it (see the module)."""

    def __init__(
        self,
        commit_logs: CommitLogs,
        send: Send,
        *,
        early: bool = False,
        wrote: Callable[[int], None] | None = None,
    ) -> None:
        self._commit_logs = commit_logs
        self.early = early
        """Publish each submission's records at once, before their commit (fsync batch)."""
        self._wrote = wrote
        """Told the bytes written early (the log's size on disk)."""
        self._send = send
        self._touched: dict[int, VbLog] = {}
        self._out: list[bytes] = []
        self._submitted = 0
        self._finished = 0
        """Submissions committed and acked (they are numbered from 1)."""
        self._work = trio.Event()
        self._done = trio.Event()
        self.pending_bytes = 0
        """Bytes read from the upstream since the commit in progress began (the reader
        adds them; ``room`` holds it back beyond ``MAX_PENDING_BYTES``)."""
        self.commits = 0
        self._started = -EARLY_COMMIT_INTERVAL
        """When the last commit started (trio's clock)."""

    def submit(self, touched: dict[int, VbLog], out: list[bytes]) -> None:
        """Logs the ingest buffered records into, and the acks and replies to send once
        they are durable."""
        if self.early:
            written = 0
            for vblog in touched.values():
                written += vblog.write_early()
            if written and self._wrote is not None:
                self._wrote(written)
        self._touched.update(touched)
        self._out += out
        self._submitted += 1
        self._work.set()

    async def run(self) -> None:
        """Commit until cancelled; a failed commit raises (nothing of it is acked)."""
        while True:
            if self._finished == self._submitted:
                await self._work.wait()
                self._work = trio.Event()
                continue
            if self.early:
                # Files touched and bytes read meanwhile count too: checked again as it goes.
                while (wait := self._started + self._spacing() - trio.current_time()) > 0:
                    await trio.sleep(min(wait, EARLY_COMMIT_INTERVAL))
                self._started = trio.current_time()
            upto = self._submitted
            touched, out = self._touched, self._out
            self._touched, self._out = {}, []
            self.pending_bytes = 0
            if touched:
                await self._commit_logs(touched)
            if out:
                await self._send(b"".join(out))
            self.commits += 1
            self._finished = upto
            self._done.set()
            self._done = trio.Event()

    def _spacing(self) -> float:
        """Seconds from the start of the last commit to the next (fsync batch)."""
        pending = self.pending_bytes
        if not QUIET_BYTES <= pending < SPACED_BYTES:
            return EARLY_COMMIT_INTERVAL
        per_file = BUSY_SPACING_PER_FILE if pending >= BUSY_BYTES else COMMIT_SPACING_PER_FILE
        return max(EARLY_COMMIT_INTERVAL, len(self._touched) * per_file)

    async def flush(self, touched: dict[int, VbLog] | None = None) -> None:
        """Until everything submitted so far (and ``touched``) is committed and acked."""
        if touched:
            self.submit(touched, [])
        upto = self._submitted
        while self._finished < upto:
            await self._done.wait()

    async def room(self) -> None:
        """Until the reader is less than ``MAX_PENDING_BYTES`` ahead of the commits."""
        while self.pending_bytes > MAX_PENDING_BYTES and self._finished < self._submitted:
            await self._done.wait()
