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

A file that cannot be read whole (not msgpack, another schema version, a
field missing or of the wrong type) is never overwritten nor half applied:
it is renamed aside (``<name>.unreadable-<UTC stamp>``, 0600), one error line
says where and why, ``tapupr_tap_front_state_set_aside_total`` counts it, and
the front starts wholly fresh: registered clients backfill, and checkpoint
ids start from the clock (``clock_first_id``), above any id handed out before.
So do they whenever there is no file to go on (no ``--state-dir``, a first
start, a deleted file): a client may hold ids of an earlier process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from pathlib import Path

import msgpack

from gateway.metrics.figures import GatewayStats
from gateway.runtime.files import fsync_dir, write_atomic

log = logging.getLogger(__name__)

STATE_FILE = "tap-front-state.msgpack"
SCHEMA_VERSION = 1
KEEP_CHECKPOINTS = 64
ID_GAP = 1 << 24
"""Checkpoint ids skipped after an unclean stop: more than a vbucket hands out
between two saves (16M; 2.x checkpoint ids are 64-bit)."""
SET_ASIDE_MARK = ".unreadable-"
U64 = (1 << 64) - 1


def clock_first_id() -> int:
    """The first checkpoint id of a state started without its lost file.

    Nanoseconds since the epoch: any earlier start began at most at its own
    clock reading, and handed out fewer than 1e9 ids per vbucket per second
    since (the ``ID_GAP`` of each unclean stop is 17 ms of clock). Below 2^63
    until 2262, so it fits the 64-bit ids of CHECKPOINT_START/END and the
    CONNECT checkpoint map (``adapters.tap.codec``) for signed readers too.
    A clock set back by the operator is the one case it cannot cover.
    """
    return time.time_ns()


class UnreadableState(ValueError):
    """The state file is not one this gateway wrote whole; the text says why."""


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
    failure: str | None = None
    """Why the last save failed, until one succeeds."""

    # Only ``open`` ever sets it: where an unreadable file went.
    set_aside: Path | None = None

    @classmethod
    def open(cls, state_dir: Path | None, stats: GatewayStats | None = None) -> Registry:
        # With no file to go on (none kept, a first start, a file deleted) ids
        # start from the clock too: a client may still hold ids of an earlier
        # process, and one handed out again would name another range.
        if state_dir is None:
            return cls(first_id=clock_first_id())
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / STATE_FILE
        registry = cls(path=path, first_id=clock_first_id())
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        if data is not None:
            try:
                loaded = decode_state(data)
            except UnreadableState as exc:
                # Kept, never overwritten: only clients' positions and ids are
                # lost, and they come back by a backfill and the clock.
                registry.set_aside = set_aside_file(path)
                registry.first_id = clock_first_id()
                if stats is not None:
                    stats.tap_front_state_set_aside_total += 1
                log.error(
                    "%s is unreadable (%s): moved to %s; registered clients will backfill, "
                    "checkpoint ids start at %d",
                    path,
                    exc,
                    registry.set_aside.name,
                    registry.first_id,
                )
            else:
                registry._apply(loaded)
        # Unclean on disk before any id is handed out: a kill from here on is seen.
        registry.dirty = True
        if not registry.save(quiet=True):
            # The file may still say clean (a full disk, a file-size limit): hand out
            # ids above every one it names, so a kill cannot make the next start reuse one.
            registry.first_id = max(
                [clock_first_id(), registry.first_id + ID_GAP]
                + [n + ID_GAP for n in registry.next_ids.values()]
            )
            registry.next_ids = {}
            log.error(
                "cannot mark %s in use (%s): checkpoint ids start at %d, above any it names; "
                "saved again at the next change",
                path,
                registry.failure,
                registry.first_id,
            )
        return registry

    def _apply(self, loaded: LoadedState) -> None:
        self.clients = loaded.clients
        self.checkpoints = loaded.checkpoints
        self.next_ids = loaded.next_ids
        self.first_id = loaded.first_id
        if not loaded.clean:
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

    def write(self, image: StateImage, *, quiet: bool = False) -> bool:
        """Replace the state file with ``image`` atomically (callable from a thread);
        False when the disk refused it: the file is as it was, and the next save
        writes the state again (one error line until a save succeeds)."""
        assert self.path is not None
        with self._writing:
            if image.generation <= self._written:
                return True  # a newer image is already on disk
            try:
                write_atomic(self.path, image.data)  # 0600, the rename fsynced
            except OSError as exc:
                self.dirty = True
                with contextlib.suppress(OSError):
                    self.path.with_name(self.path.name + ".tmp").unlink()
                if self.failure is None and not quiet:
                    log.error(
                        "cannot save %s (%s): registered clients' positions and checkpoint "
                        "ids stay in memory; saved again at the next change",
                        self.path,
                        exc.strerror or exc,
                    )
                self.failure = str(exc.strerror or exc)
                return False
            if self.failure is not None:
                log.info("%s saved again", self.path)
                self.failure = None
            self._written = image.generation
            return True

    def save(self, *, clean: bool = False, quiet: bool = False) -> bool:
        """Write the state now (``clean``: on shutdown, nothing will change after it);
        False when the disk refused it (see ``write``)."""
        self.dirty = self.dirty or clean
        data = self.image(clean=clean)
        return True if data is None else self.write(data, quiet=quiet)


# -- reading the file ----------------------------------------------------------


@dataclass(slots=True)
class LoadedState:
    """A state file read whole and checked field by field."""

    clients: dict[str, dict[int, VbResume]]
    checkpoints: dict[int, OrderedDict[int, VbResume]]
    next_ids: dict[int, int]
    first_id: int
    clean: bool


def decode_state(data: bytes) -> LoadedState:
    """The state file's contents, or ``UnreadableState`` naming the first field wrong."""
    try:
        top = msgpack.unpackb(data, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise UnreadableState(f"not msgpack: {exc}") from None
    top = _map(top, "the file")
    version = top.get("version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise UnreadableState(f"schema version {version!r}, this gateway reads {SCHEMA_VERSION}")
    clients: dict[str, dict[int, VbResume]] = {}
    for name, positions in _map(_field(top, "clients"), "clients").items():
        if not isinstance(name, str):
            raise UnreadableState(f"clients: a name {name!r} is not text")
        where = f"clients[{name!r}]"
        clients[name] = {
            _vbucket(vb, where): _position(pos, f"{where}[{vb}]")
            for vb, pos in _map(positions, where).items()
        }
    checkpoints: dict[int, OrderedDict[int, VbResume]] = {}
    for vb, entries in _map(_field(top, "checkpoints"), "checkpoints").items():
        where = f"checkpoints[{vb!r}]"
        ends: OrderedDict[int, VbResume] = OrderedDict()
        for entry in _list(entries, where):
            pair = _list(entry, where)
            if len(pair) != 2:
                raise UnreadableState(f"{where}: an entry of {len(pair)} fields, not 2")
            ends[_u64(pair[0], where)] = _position(pair[1], where)
        checkpoints[_vbucket(vb, "checkpoints")] = ends
    next_ids = {
        _vbucket(vb, "next_ids"): _u64(n, f"next_ids[{vb!r}]")
        for vb, n in _map(_field(top, "next_ids"), "next_ids").items()
    }
    first_id = _u64(top.get("first_id", 1), "first_id")  # files before it: 1
    clean = top.get("clean", False)
    if not isinstance(clean, bool):
        raise UnreadableState(f"clean: {clean!r} is not true or false")
    return LoadedState(clients, checkpoints, next_ids, first_id, clean)


def _field(top: dict[object, object], name: str) -> object:
    if name not in top:
        raise UnreadableState(f"{name}: missing")
    return top[name]


def _map(value: object, where: str) -> dict[object, object]:
    if not isinstance(value, dict):
        raise UnreadableState(f"{where}: {type(value).__name__} where a map belongs")
    return value


def _list(value: object, where: str) -> list[object]:
    if not isinstance(value, list):
        raise UnreadableState(f"{where}: {type(value).__name__} where a list belongs")
    return value


def _u64(value: object, where: str) -> int:
    # bool is an int to Python, never to this file.
    if type(value) is not int or not 0 <= value <= U64:
        raise UnreadableState(f"{where}: {value!r} is not a 64-bit unsigned integer")
    return value


def _vbucket(value: object, where: str) -> int:
    if type(value) is not int or not 0 <= value <= 0xFFFF:
        raise UnreadableState(f"{where}: {value!r} is not a vbucket id")
    return value


def _position(value: object, where: str) -> VbResume:
    fields = _list(value, where)
    # Four fields before checkpoint_id and backfill_done were kept; their defaults apply.
    if not 4 <= len(fields) <= 6:
        raise UnreadableState(f"{where}: a position of {len(fields)} fields, not 4 to 6")
    numbers = [_u64(n, where) for n in fields[:5]] + [0]
    backfill_done = fields[5] if len(fields) == 6 else True
    if not isinstance(backfill_done, bool):
        raise UnreadableState(f"{where}: backfill_done {backfill_done!r} is not true or false")
    uuid, seqno, snap_start, snap_end, checkpoint_id = numbers[:5]
    return VbResume(uuid, seqno, snap_start, snap_end, checkpoint_id, backfill_done)


def set_aside_file(path: Path) -> Path:
    """Rename ``path`` aside (0600, durable before anything replaces it); its new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}{SET_ASIDE_MARK}{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{SET_ASIDE_MARK}{stamp}-{n}")
    os.rename(path, target)
    target.chmod(0o600)
    fsync_dir(path.parent)
    return target
