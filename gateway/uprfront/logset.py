"""Every vbucket's durable log under one state directory.

Opened once per gateway process: the vbuckets found on disk, and those the
manifest (``manifest``) lists, are opened and proven at start (so consumers
can stream what was logged before the upstream is reachable), new ones as
the upstream names them. A vbucket whose log cannot be proven is set aside
and started over (see ``vblog``), counted in
``GatewayStats.upr_log.logs_set_aside_total``.

The manifest is rewritten after start-up, whenever a vbucket is added, and
whenever a log's seqno reservation moves up. A manifest that is missing or
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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.stats import GatewayStats
from gateway.uprfront.manifest import MANIFEST_NAME, KnownVb, read_manifest, write_manifest
from gateway.uprfront.proof import set_aside_root
from gateway.uprfront.vblog import DEFAULT_SEGMENT_BYTES, DEFAULT_TAIL_BYTES, VbLog

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
            self._open(vb)
        self.save_manifest()
        self.refresh_stats()

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

    def _open(self, vbucket: int) -> VbLog:
        o = self.options
        vblog = VbLog(
            self.root,
            vbucket,
            fsync=o.fsync,
            segment_bytes=o.segment_bytes,
            expiry_tolerance=o.expiry_tolerance,
            rng=self.rng,
            tail_bytes=o.tail_bytes,
        )
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
        if vblog.problems:
            self.stats.upr_log.logs_set_aside_total[vblog.problems[0].kind] += 1
        vblog.on_reserve = self._reserved
        self.logs[vbucket] = vblog
        return vblog

    def _reserved(self, vblog: VbLog) -> None:
        self.save_manifest()

    def save_manifest(self) -> None:
        for vb, vblog in self.logs.items():
            known = self.known.setdefault(vb, KnownVb())
            known.remember(vblog.reserved, [u for u, _ in reversed(vblog.failover.entries)])
        write_manifest(self.manifest_path, self.known)

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
