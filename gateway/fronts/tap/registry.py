"""What the TAP front remembers between connections: positions and checkpoints.

Theory of operation. Two things outlive a TAP connection:

- per registered client name and vbucket, the last position the client
  acknowledged (``VbResume``: upstream uuid, seqno, snapshot range,
  checkpoint id, whether its backfill had finished), so a client that
  reconnects under its name resumes instead of backfilling again;
- per vbucket, where each checkpoint the gateway handed out ended, so a
  client that reconnects with the CHECKPOINT flag and its last closed
  checkpoint id can be resumed by seqno upstream. Checkpoint ids come from
  one counter per vbucket shared by every connection, so an id names one
  range whoever received it. The newest ``KEEP_CHECKPOINTS`` per vbucket
  are kept; an older id means a full backfill, as a 2.x server did once it
  had purged the checkpoint.

With a state directory both live in one msgpack file, rewritten atomically
(temporary file, fsync, rename) when something changed and at most every
``save_interval`` seconds, and once more on shutdown. Positions only move
forward on acknowledgement, so a file older than the truth makes a client
resume a little early (duplicates it already has), never late (a gap).

Checkpoint ids are the exception: one handed out after the last save must
never name another range after a restart, or a client resuming from it would
skip what it never received. Only the shutdown save marks the file clean
(opening it marks it unclean at once); a file not clean moves every counter,
and the first id of vbuckets it never counted, ``ID_GAP`` further on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from pathlib import Path

import msgpack

log = logging.getLogger(__name__)

STATE_FILE = "tap-front-state.msgpack"
SCHEMA_VERSION = 1
KEEP_CHECKPOINTS = 64
ID_GAP = 1 << 24
"""Checkpoint ids skipped after an unclean stop: more than a vbucket hands out
between two saves (16M; 2.x checkpoint ids are 64-bit)."""


@dataclass(frozen=True, slots=True)
class VbResume:
    """Where a client stands in one vbucket, in the upstream's terms."""

    uuid: int
    seqno: int
    snap_start: int
    snap_end: int
    checkpoint_id: int = 0
    backfill_done: bool = True


@dataclass(frozen=True, slots=True)
class StateImage:
    """The state file's bytes as of one moment; later moments have higher generations."""

    generation: int
    data: bytes


@dataclass
class Registry:
    """Registered clients and checkpoint ends (see the module docstring)."""

    path: Path | None = None
    clients: dict[str, dict[int, VbResume]] = field(default_factory=dict)
    checkpoints: dict[int, OrderedDict[int, VbResume]] = field(default_factory=dict)
    next_ids: dict[int, int] = field(default_factory=dict)
    first_id: int = 1
    """The first checkpoint id of a vbucket not in ``next_ids``."""
    dirty: bool = False
    # Saves come from the loop (a session ending) and from a worker thread (the
    # periodic save): one writer at a time, and an older image never
    # replaces a newer one.
    _generation: int = 0
    _written: int = 0
    _writing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, state_dir: Path | None) -> Registry:
        if state_dir is None:
            return cls()
        state_dir.mkdir(parents=True, exist_ok=True)
        registry = cls(path=state_dir / STATE_FILE)
        try:
            data = registry.path.read_bytes()  # type: ignore[union-attr]
        except FileNotFoundError:
            data = None
        try:
            if data is not None:
                registry._load(msgpack.unpackb(data, strict_map_key=False))
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            # Starting over costs clients a backfill; refusing to start costs more.
            log.error("%s is unreadable (%s); registered clients will backfill", registry.path, exc)
        # Unclean on disk before any id is handed out: a kill from here on is seen.
        registry.dirty = True
        registry.save()
        return registry

    def _load(self, data: dict[str, object]) -> None:
        if data.get("version") != SCHEMA_VERSION:
            raise ValueError(f"schema version {data.get('version')!r}")
        clients = data["clients"]
        checkpoints = data["checkpoints"]
        next_ids = data["next_ids"]
        assert isinstance(clients, dict) and isinstance(checkpoints, dict)
        assert isinstance(next_ids, dict)
        self.clients = {
            name: {int(vb): VbResume(*pos) for vb, pos in positions.items()}
            for name, positions in clients.items()
        }
        self.checkpoints = {
            int(vb): OrderedDict((int(cp), VbResume(*pos)) for cp, pos in entries)
            for vb, entries in checkpoints.items()
        }
        self.next_ids = {int(vb): int(n) for vb, n in next_ids.items()}
        self.first_id = int(data.get("first_id", 1))  # type: ignore[call-overload]
        if not data.get("clean"):
            # Ids may have been handed out past the counters saved: skip them.
            self.next_ids = {vb: n + ID_GAP for vb, n in self.next_ids.items()}
            self.first_id += ID_GAP
            log.warning(
                "%s was not closed cleanly: checkpoint ids go on from +%d", self.path, ID_GAP
            )

    # -- registered clients ---------------------------------------------------

    def positions(self, name: str) -> dict[int, VbResume] | None:
        return self.clients.get(name)

    def register(self, name: str) -> dict[int, VbResume]:
        if name not in self.clients:
            self.clients[name] = {}
            self.dirty = True
        return self.clients[name]

    def advance(self, name: str, vbucket: int, position: VbResume) -> None:
        positions = self.clients.get(name)
        if positions is not None:
            positions[vbucket] = position
            self.dirty = True

    def forget(self, name: str) -> bool:
        self.dirty = True
        return self.clients.pop(name, None) is not None

    # -- checkpoints ----------------------------------------------------------

    def checkpoint_ids(self, vbucket: int) -> Iterator[int]:
        """Endless ids for new checkpoints of ``vbucket``, shared by every stream."""
        while True:
            current = self.next_ids.get(vbucket, self.first_id)
            self.next_ids[vbucket] = current + 1
            self.dirty = True
            yield current

    def checkpoint_closed(self, vbucket: int, checkpoint_id: int, end: VbResume) -> None:
        entries = self.checkpoints.setdefault(vbucket, OrderedDict())
        entries[checkpoint_id] = end
        while len(entries) > KEEP_CHECKPOINTS:
            entries.popitem(last=False)
        self.dirty = True

    def checkpoint_ends(self) -> dict[tuple[int, int], VbResume]:
        return {
            (vb, cp): end for vb, entries in self.checkpoints.items() for cp, end in entries.items()
        }

    # -- persistence ----------------------------------------------------------

    def image(self, *, clean: bool = False) -> StateImage | None:
        """The state file's contents if anything changed since the last one (else None);
        ``clean`` only for the last one, after every stream stopped."""
        if self.path is None or not self.dirty:
            return None
        self.dirty = False
        self._generation += 1
        packed: bytes = msgpack.packb(
            {
                "version": SCHEMA_VERSION,
                "clients": {
                    name: {vb: astuple(pos) for vb, pos in positions.items()}
                    for name, positions in self.clients.items()
                },
                "checkpoints": {
                    vb: [(cp, astuple(end)) for cp, end in entries.items()]
                    for vb, entries in self.checkpoints.items()
                },
                "next_ids": self.next_ids,
                "first_id": self.first_id,
                "clean": clean,
            }
        )
        return StateImage(self._generation, packed)

    def write(self, image: StateImage) -> None:
        """Replace the state file with ``image`` atomically (callable from a thread)."""
        assert self.path is not None
        with self._writing:
            if image.generation <= self._written:
                return  # a newer image is already on disk
            temporary = self.path.with_suffix(".tmp")
            with open(temporary, "wb") as handle:
                handle.write(image.data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
            self._written = image.generation

    def save(self, *, clean: bool = False) -> None:
        """Write the state now (``clean``: on shutdown, nothing will change after it)."""
        self.dirty = self.dirty or clean
        data = self.image(clean=clean)
        if data is not None:
            self.write(data)
