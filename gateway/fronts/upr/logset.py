"""Every vbucket's durable log under one state directory.

Opened once per gateway process: the vbuckets found on disk, and those the
manifest (``manifest``) lists, are opened and proven at start (so consumers
can stream what was logged before the upstream is reachable), new ones as
the upstream names them. A vbucket whose log cannot be proven is set aside
and started over (see ``vblog``), counted in
``GatewayStats.upr_log.logs_set_aside_total``.

The manifest is rewritten after start-up, whenever a vbucket is added, and
whenever a log's seqno reservation moves up. Opening and proving logs, and
the fsyncs of their metas and the manifest (a few hundred for 64 new logs),
run in a worker thread (``open_existing_async``, ``ensure_all``): on the trio
loop they stalled every connection for up to a second. Manifest writes are
numbered and a write older than the last one written is dropped, as each
is built on the trio thread from the cumulative ``known``. A manifest that is missing or
damaged while vbucket directories exist is rebuilt from the logs; until
then a vbucket without a directory cannot be told from a new one, so the
log set counts it as lost (set aside and re-fetched) rather than serve it
as empty history.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from gateway.fronts.upr.manifest import (
    MANIFEST_NAME,
    KnownVb,
    pack_manifest,
    read_manifest,
)
from gateway.fronts.upr.proof import Problem, set_aside_root
from gateway.fronts.upr.vblog import DEFAULT_SEGMENT_BYTES, DEFAULT_TAIL_BYTES, VbLog
from gateway.metrics.figures import GatewayStats
from gateway.runtime.files import write_atomic

log = logging.getLogger(__name__)

_VB_DIR = re.compile(r"vb-(\d{4})$")


@dataclass
class LogOptions:
    fsync: str = "batch"
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    expiry_tolerance: float = 1.0
    tail_bytes: int = DEFAULT_TAIL_BYTES


def vbucket_dirs(root: Path) -> dict[int, Path]:
    """The ``vb-NNNN`` directories directly under ``root``, by vbucket."""
    out = {}
    if root.is_dir():
        for path in root.iterdir():
            match = _VB_DIR.match(path.name)
            if match and path.is_dir():
                out[int(match.group(1))] = path
    return out


def manifest_state(root: Path, dirs: dict[int, Path]) -> tuple[dict[int, KnownVb], str | None]:
    """(the manifest's entries, why vbuckets without a directory count as lost, or None)."""
    known, wrong = read_manifest(root / MANIFEST_NAME)
    if known is not None:
        return known, None
    if not dirs:
        return {}, None  # a new state directory
    return {}, f"other vbuckets have logs and {MANIFEST_NAME} is {wrong}"


class LogSet:
    def __init__(
        self, root: Path, options: LogOptions, stats: GatewayStats, seed: int | None = None
    ) -> None:
        self.root = root
        self.options = options
        self.stats = stats
        self.rng = random.Random(seed)
        self.logs: dict[int, VbLog] = {}
        self.known: dict[int, KnownVb] = {}
        """The manifest: every vbucket with a log, and what bounds its seqnos and uuids."""
        self.lost_manifest: str | None = None
        self._opened = False
        self._opening = trio.Lock()
        """One ``ensure_all`` at a time: two must not open the same vbucket."""
        self._manifest_lock = threading.Lock()
        self._manifest_built = 0
        """Number of the latest manifest built (on the trio thread)."""
        self._manifest_written = 0
        """Number of the latest manifest written: an older one is never written after it."""

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    def open_existing(self) -> None:
        self._opened = True
        self.root.mkdir(parents=True, exist_ok=True)
        dirs = vbucket_dirs(self.root)
        self.known, self.lost_manifest = manifest_state(self.root, dirs)
        if self.lost_manifest is not None:
            if self.manifest_path.exists():
                self._keep_damaged_manifest()
            log.warning(
                "%s: vbuckets without a log directory are treated as lost; "
                "the manifest is rebuilt from the logs",
                self.lost_manifest,
            )
        for vb in sorted(set(dirs) | set(self.known)):
            try:
                self._open(vb)
            except OSError as exc:
                raise self._refused(f"vb-{vb:04d}", exc) from None
        try:
            self.save_manifest()
        except OSError as exc:
            raise self._refused(MANIFEST_NAME, exc) from None
        self.refresh_stats()

    def _refused(self, what: str, exc: OSError) -> Exception:
        # An unclean log must record its new history before anything is served from
        # it; a disk that refuses that (full, a file-size limit) stops the start, with
        # the state directory named rather than the listener the front was starting.
        from gateway.cli.startup import StartupError  # the CLI imports the fronts

        return StartupError(
            f"--state-dir {self.root}: cannot open the UPR front's log: writing "
            f"{what} failed: {exc.strerror or exc}"
        )

    async def open_existing_async(self) -> None:
        """``open_existing`` in a worker thread (start-up: nothing else uses the set yet)."""
        await trio.to_thread.run_sync(self.open_existing)

    def _keep_damaged_manifest(self) -> None:
        base = set_aside_root(self.root)
        base.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        os.rename(self.manifest_path, base / f"{MANIFEST_NAME}-{stamp}")

    def ensure(self, vbucket: int) -> VbLog:
        if not self._opened:
            self.open_existing()  # the manifest first: it decides what a missing log means
        vblog = self.logs.get(vbucket)
        if vblog is None:
            vblog = self._open(vbucket)
            self.save_manifest()
            self.refresh_stats()
        return vblog

    async def ensure_all(self, vbuckets: Iterable[int]) -> list[VbLog]:
        """The logs of ``vbuckets``, opening the missing ones (and the manifest, first
        of all) in a worker thread; a new log is in ``logs`` once the manifest lists it."""
        wanted = list(vbuckets)
        async with self._opening:
            if not self._opened:
                await self.open_existing_async()
            missing = [vb for vb in dict.fromkeys(wanted) if vb not in self.logs]
            if missing:
                opened = await trio.to_thread.run_sync(self._open_detached, missing)
                for vblog in opened:
                    self._remember(vblog)
                number, data = self._build_manifest()
                try:
                    await trio.to_thread.run_sync(self._write_manifest, number, data)
                except BaseException:
                    for vblog in opened:
                        vblog.abandon()
                    raise
                for vblog in opened:
                    self._adopt(vblog)
                self.refresh_stats()
        return [self.logs[vb] for vb in wanted]

    def _open_detached(self, vbuckets: list[int]) -> list[VbLog]:
        """Open and prove ``vbuckets`` without adding them to the set (a worker thread)."""
        opened: list[VbLog] = []
        try:
            for vb in vbuckets:
                opened.append(self._prove(vb))
        except BaseException:
            for vblog in opened:
                vblog.abandon()
            raise
        return opened

    def _open(self, vbucket: int) -> VbLog:
        vblog = self._prove(vbucket)
        self._adopt(vblog)
        return vblog

    def _new(self, vbucket: int) -> VbLog:
        o = self.options
        return VbLog(
            self.root,
            vbucket,
            fsync=o.fsync,
            segment_bytes=o.segment_bytes,
            expiry_tolerance=o.expiry_tolerance,
            rng=self.rng,
            tail_bytes=o.tail_bytes,
        )

    def start_over(self, damaged: VbLog, problem: Problem) -> VbLog:
        """Set aside ``damaged`` (found damaged while serving; nobody may be writing it)
        and replace it with a log that starts over, as start-up does with a log it cannot
        prove: a new history and a re-fetch from the TAP node. On the trio thread (a few
        fsyncs): nothing may touch the vbucket between the two."""
        damaged.retire(f"vbucket {damaged.vbucket}: log set aside: {problem.text}")
        known = self.known.get(damaged.vbucket)
        vblog = self._new(damaged.vbucket)
        vblog.open_over(
            damaged, problem, known.reserved if known else 0, known.uuids if known else ()
        )
        self._adopt(vblog)
        self.save_manifest()
        self.refresh_stats()
        return vblog

    async def start_over_async(self, damaged: VbLog, problem: Problem) -> VbLog:
        """``start_over`` with the set-aside rename, the new log and their fsyncs in a
        worker thread, in the same order. The caller keeps everyone off ``damaged``
        meanwhile (its lock held); no log is opened until the new one is in ``logs``."""
        async with self._opening:
            damaged.retire(f"vbucket {damaged.vbucket}: log set aside: {problem.text}")
            known = self.known.get(damaged.vbucket)
            vblog = self._new(damaged.vbucket)
            await trio.to_thread.run_sync(
                vblog.open_over,
                damaged,
                problem,
                known.reserved if known else 0,
                known.uuids if known else (),
            )
            self._remember(vblog)
            number, data = self._build_manifest()
            await trio.to_thread.run_sync(self._write_manifest, number, data)
            self._adopt(vblog)
            self.refresh_stats()
        return vblog

    def _prove(self, vbucket: int) -> VbLog:
        vblog = self._new(vbucket)
        known = self.known.get(vbucket)
        if known is not None:
            expected: str | None = f"{MANIFEST_NAME} lists vbucket {vbucket}"
        else:
            expected = self.lost_manifest
        vblog.open(
            expected=expected,
            known_bound=known.reserved if known else 0,
            known_uuids=known.uuids if known else (),
        )
        return vblog

    def _adopt(self, vblog: VbLog) -> None:
        if vblog.problems:
            self.stats.upr_log.logs_set_aside_total[vblog.problems[0].kind] += 1
        vblog.on_reserve = self._reserved
        self.logs[vblog.vbucket] = vblog

    def _reserved(self, vblog: VbLog) -> None:
        self.save_manifest()

    def save_manifest(self) -> None:
        for vblog in self.logs.values():
            self._remember(vblog)
        self._write_manifest(*self._build_manifest())

    def _remember(self, vblog: VbLog) -> None:
        known = self.known.setdefault(vblog.vbucket, KnownVb())
        known.remember(vblog.reserved, [u for u, _ in reversed(vblog.failover.entries)])

    def _build_manifest(self) -> tuple[int, bytes]:
        """The manifest of ``known`` (every log ever opened), numbered (the trio thread)."""
        self._manifest_built += 1
        return self._manifest_built, pack_manifest(self.known)

    def _write_manifest(self, number: int, data: bytes) -> None:
        """Write manifest ``number`` unless a later one was written (any thread): each
        holds everything the earlier ones did, as ``known`` only grows."""
        with self._manifest_lock:
            if number > self._manifest_written:
                write_atomic(self.manifest_path, data)
                self._manifest_written = number

    def get(self, vbucket: int) -> VbLog | None:
        return self.logs.get(vbucket)

    def __iter__(self) -> Iterator[VbLog]:
        return iter(self.logs.values())

    def refresh_stats(self) -> None:
        upr_log = self.stats.upr_log
        upr_log.failover_log_lengths = {vb: len(v.failover) for vb, v in self.logs.items()}
        upr_log.bytes_on_disk = sum(v.bytes_on_disk() for v in self.logs.values())

    def close(self) -> None:
        for vblog in self.logs.values():
            vblog.close()

    def abandon(self) -> None:
        for vblog in self.logs.values():
            vblog.abandon()
