"""Every vbucket's durable log under one state directory.

Opened once per gateway process: the vbuckets found on disk are opened at
start (so consumers can stream what was logged before the upstream is
reachable), new ones as the upstream names them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.stats import GatewayStats
from gateway.uprfront.vblog import DEFAULT_SEGMENT_BYTES, DEFAULT_TAIL_BYTES, VbLog

_VB_DIR = re.compile(r"vb-(\d{4})$")


@dataclass
class LogOptions:
    fsync: str = "batch"
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    expiry_tolerance: float = 1.0
    tail_bytes: int = DEFAULT_TAIL_BYTES


class LogSet:
    def __init__(
        self, root: Path, options: LogOptions, stats: GatewayStats, seed: int | None = None
    ) -> None:
        self.root = root
        self.options = options
        self.stats = stats
        self.rng = random.Random(seed)
        self.logs: dict[int, VbLog] = {}

    def open_existing(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.root.iterdir()):
            match = _VB_DIR.match(path.name)
            if match and path.is_dir():
                self.ensure(int(match.group(1)))

    def ensure(self, vbucket: int) -> VbLog:
        vblog = self.logs.get(vbucket)
        if vblog is None:
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
            vblog.open()
            self.logs[vbucket] = vblog
            self.refresh_stats()
        return vblog

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
