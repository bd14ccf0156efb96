"""Kill -9 harness of the UPR front: ``serve`` as its own process, killed at random moments.

The test process runs the reference node (a 2.x-style TAP producer whose
registered client resumes from what it acked, as 2.5.1's cursor moves on),
a writer on it, and a UPR consumer of the front that behaves as a 3.0
consumer across restarts: it keeps per vbucket the last seqno it received,
the last snapshot marker's range and the latest failover entry's uuid, asks
STREAM_REQ with them after each restart and honours ROLLBACK
(ep-engine v3.0.0 src/upr-consumer.cc ``UprConsumer::handleResponse``,
``doRollback``; src/failover-table.cc ``needsRollback``).

After each SIGKILL, once the node saw the TAP connection end (so every ack
the process sent has been read), the state directory is copied and the copy
opened as the next start opens it (``LogSet.open_existing``): that is the
log the next run proves and serves. Checked there and on reconnection:

- every version the node holds at a seqno its registered client acked is
  the log's version of that key (a 2.5.1 producer never sends it again);
- nothing is set aside: SIGKILL leaves the page cache whole, so at worst a
  torn tail, never an unprovable log;
- a seqno the consumer holds after a STREAM_REQ was answered is in the log
  with the same key, value, cas and rev_seqno, or its key has a later
  version there; a ROLLBACK goes no higher than the consumer's seqno;
- a (vbucket, seqno) is never served with two different items, across
  every run (the README: by_seqnos are never reused, across a SIGKILL too);
- state directories are 0700 and files 0600.

``serve`` runs through ``gateway.cli.main`` with two ``UprFrontConfig``
defaults lowered (compaction every ``compact_interval`` s, segments of
``segment_bytes``) so kills land during compactions and segment rolls too.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import Status
from adapters.translate.log_records import LogItem
from adapters.upr.items import ItemKind
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.metrics.figures import GatewayStats
from gateway.node.items import StoreError
from gateway.node.store import Store
from tests.support.upr_client import MAX_SEQNO, UprClient

TAP_NAME = "upr-front"
"""The front's registered TAP client name (``UprFrontConfig.tap_name``)."""

SERVE = """
import dataclasses, sys
import gateway.fronts.upr as front

@dataclasses.dataclass
class Tuned(front.UprFrontConfig):
    compact_interval: float = float(sys.argv[1])
    segment_bytes: int = int(sys.argv[2])

front.UprFrontConfig = Tuned
from gateway.cli.main import main
sys.exit(main(["serve", *sys.argv[3:]]))
"""

FSYNC_MODES = ("batch", "batch", "always", "never")
"""``--fsync`` of each run (an operator may change it between restarts)."""

Item = tuple[bytes, bytes | None, int, int]
"""What a consumer can tell of a version: key, value (None: deleted), cas, rev_seqno."""


def event_item(event: upr.Mutation | upr.Deletion | upr.Expiration) -> Item:
    value = event.value if isinstance(event, upr.Mutation) else None
    return event.key, value, event.cas, event.rev_seqno


def log_item(item: LogItem) -> Item:
    value = item.value if item.kind is ItemKind.MUTATION else None
    return item.key, value, item.cas, item.rev_seqno


# -- the upstream's writer ------------------------------------------------------


class Writer:
    """Sets, overwrites and deletes on the node, a batch every few milliseconds."""

    def __init__(self, store: Store, rng: random.Random, *, keys: int = 300) -> None:
        self.store = store
        self.rng = rng
        self.keys = keys
        self.scope = trio.CancelScope()
        self.written = 0

    def write(self, n: int, now: float) -> None:
        rng = self.rng
        for _ in range(n):
            vb = rng.randrange(self.store.n_vbuckets)
            key = b"key-%d" % rng.randrange(self.keys)
            try:
                if rng.random() < 0.15:
                    self.store.delete(vb, key, now=now)
                else:
                    value = bytes([97 + self.written % 26]) * rng.choice((8, 100, 1500))
                    self.store.set(vb, key, value, flags=self.written, now=now)
            except StoreError:  # not there: nothing to delete
                pass
            self.written += 1

    async def run(self, batch: int = 10) -> None:
        with self.scope:
            while True:
                self.write(batch, time.time())
                await trio.sleep(0.01)


# -- the gateway process --------------------------------------------------------


class Gateway:
    """One process of ours (``serve``, or a ``node``); its log kept in ``lines``, the port
    its log line matching ``pattern`` names in ``port``."""

    def __init__(self, proc: trio.Process, pattern: str) -> None:
        self.proc = proc
        self.pattern = re.compile(pattern)
        self.lines: list[str] = []
        self.port = 0
        self.listening = trio.Event()
        self.exited = trio.Event()

    @classmethod
    async def run(cls, nursery: trio.Nursery, command: list[str], pattern: str) -> Gateway:
        proc = await trio.lowlevel.open_process(command, stderr=-1)  # subprocess.PIPE
        gateway = cls(proc, pattern)
        nursery.start_soon(gateway._read_log)
        return gateway

    @classmethod
    async def start(
        cls,
        nursery: trio.Nursery,
        node_port: int,
        state_dir: Path,
        *,
        compact_interval: float = 0.3,
        segment_bytes: int = 32 * 1024,
        fsync: str = "batch",
    ) -> Gateway:
        """``serve`` with the UPR front on ``node_port``'s TAP."""
        command = [sys.executable, "-c", SERVE, str(compact_interval), str(segment_bytes),
                   "--tap-upstream", f"127.0.0.1:{node_port}", "--upr-listen", "127.0.0.1:0",
                   "--no-metrics", "--state-dir", str(state_dir), "--fsync", fsync]  # fmt: skip
        return await cls.run(nursery, command, r"UPR front listening on 127\.0\.0\.1:(\d+)")

    async def _read_log(self) -> None:
        assert self.proc.stderr is not None
        pending = b""
        try:
            while chunk := await self.proc.stderr.receive_some(65536):
                pending += chunk
                *whole, pending = pending.split(b"\n")
                for raw in whole:
                    line = raw.decode("utf-8", "replace")
                    self.lines.append(line)
                    found = self.pattern.search(line)
                    if found:
                        self.port = int(found.group(1))
                        self.listening.set()
        except trio.Cancelled:
            self.kill()  # the test ended early (it failed): no process outlives it
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self.proc.wait()
            self.exited.set()

    def kill(self) -> None:
        if self.proc.returncode is None:  # not yet reaped (a SIGTERM may have ended it)
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> int:
        """SIGTERM, as a supervisor stops it; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        await self.exited.wait()
        return self.proc.returncode if self.proc.returncode is not None else -1

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])


# -- what the log holds after a kill ---------------------------------------------


@dataclass
class LogView:
    """The log as the next start proves it (opened from a copy of the state directory)."""

    items: dict[int, dict[int, Item]]
    """Per vbucket, seqno -> item."""
    latest: dict[int, dict[bytes, int]]
    """Per vbucket, key -> its highest seqno in the log."""
    torn: int
    high: dict[int, int]


def private_state(root: Path) -> list[str]:
    """Everything under ``root`` that others could read: dirs not 0700, files not 0600."""
    wrong = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        want = 0o700 if path.is_dir() else 0o600
        if mode != want:
            wrong.append(f"{path.relative_to(root)} {mode:o}")
    return wrong


def open_copy(state_dir: Path, scratch: Path) -> LogView:
    """Copy the state directory and prove the copy as ``serve`` would; its contents."""
    if scratch.exists():
        shutil.rmtree(scratch)
    if state_dir.exists():
        shutil.copytree(state_dir, scratch)
    logs = LogSet(scratch, LogOptions(), GatewayStats())
    quiet = logging.getLogger("gateway")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the copy's own "not closed cleanly" lines
    try:
        logs.open_existing()
    finally:
        quiet.setLevel(level)
    try:
        problems = {vb: v.problems for vb, v in logs.logs.items() if v.problems}
        assert not problems, f"a log set aside after SIGKILL: {problems}"
        assert logs.lost_manifest is None, logs.lost_manifest
        items: dict[int, dict[int, Item]] = {}
        latest: dict[int, dict[bytes, int]] = {}
        for vb, vblog in logs.logs.items():
            read = vblog.read(0, MAX_SEQNO, 10**9)
            items[vb] = {i.by_seqno: log_item(i) for i in read}
            latest[vb] = {i.key: i.by_seqno for i in read}
        torn = sum(v.torn_bytes for v in logs.logs.values())
        high = {vb: v.high_seqno for vb, v in logs.logs.items()}
        return LogView(items, latest, torn, high)
    finally:
        logs.abandon()


def check_acked_in_log(store: Store, positions: dict[int, int], view: LogView) -> int:
    """Every version the node holds at or below its client's acked seqno is the log's
    latest of that key; how many were checked."""
    checked = 0
    for vb, acked in positions.items():
        logged = view.items.get(vb, {})
        latest = view.latest.get(vb, {})
        for item in store.items_since(vb, 0, acked):
            seqno = latest.get(item.key)
            assert seqno is not None, f"vb {vb}: acked {item.key!r} (node seqno {item.by_seqno} "
            f"<= acked {acked}) is not in the log"
            assert logged[seqno][2] == item.cas, (
                f"vb {vb}: acked {item.key!r} cas {item.cas} (node seqno {item.by_seqno} <= "
                f"acked {acked}) but the log's latest is {logged[seqno]} at seqno {seqno}"
            )
            checked += 1
    return checked


# -- the 3.0 consumer -------------------------------------------------------------


@dataclass
class VbView:
    """What the consumer holds of one vbucket."""

    uuid: int = 0
    seqno: int = 0
    snap: tuple[int, int] = (0, 0)
    items: dict[int, Item] = field(default_factory=dict)
    failover: upr.FailoverEntries = ()
    """The failover log of the last stream's answer (newest first)."""

    def rollback(self, to: int) -> None:
        self.items = {s: i for s, i in self.items.items() if s <= to}
        self.seqno = to
        self.snap = (to, to)

    def request_snap(self) -> tuple[int, int]:
        """As a consumer after 3.0.0 asks: a snapshot received whole, or none of whose items
        came (only its marker), counts as (seqno, seqno). That is later kv_engine's
        dcp-stream.cc ``PassiveStream``, which records a snapshot with its first
        item (``saveSnapshot``); 3.0.0's upr-stream.cc ``processMarker`` recorded it
        at the marker, so a 3.0.0 consumer asked (seqno, marker start, marker end)
        and was refused ERANGE."""
        start, end = self.snap
        return (start, end) if start <= self.seqno < end else (self.seqno, self.seqno)

    def state(self) -> dict[bytes, tuple[int, bytes | None]]:
        out: dict[bytes, tuple[int, bytes | None]] = {}
        for seqno in sorted(self.items):
            key, value, cas, _rev = self.items[seqno]
            out[key] = (cas, value)
        return out


class Consumer:
    """A UPR consumer that follows the front across restarts (see the module docstring)."""

    def __init__(
        self, vbuckets: int, name: bytes = b"crash-consumer", *, unique_seqnos: bool = True
    ) -> None:
        self.name = name
        self.unique_seqnos = unique_seqnos
        """Check that no (vbucket, seqno) is ever served as two items (the front's promise;
        a 3.0 node that lost unflushed items hands their seqnos out again, under a new
        failover entry)."""
        self.views = {vb: VbView() for vb in range(vbuckets)}
        self.served: dict[tuple[int, int], Item] = {}
        self.rollbacks: list[tuple[int, int, int]] = []
        """(vbucket, from seqno, to seqno) of every ROLLBACK honoured."""
        self.sessions = 0
        """Sessions whose every stream was requested (the rollbacks honoured)."""
        self.items_received = 0
        self.changed = trio.Event()

    def check_against(self, vb: int, view: LogView | None) -> None:
        """Everything the consumer holds of ``vb`` is in the log the front opened."""
        if view is None:
            return
        logged = view.items.get(vb, {})
        latest = view.latest.get(vb, {})
        for seqno, item in self.views[vb].items.items():
            if seqno in logged:
                assert logged[seqno] == item, (
                    f"vb {vb} seqno {seqno}: the consumer holds {item}, the log {logged[seqno]}"
                )
            else:
                assert latest.get(item[0], 0) > seqno, (
                    f"vb {vb} seqno {seqno} {item}: held by the consumer, not rolled back, "
                    f"and neither it nor a later version of its key is in the log"
                )

    async def _request(self, client: UprClient, vb: int, view: LogView | None) -> None:
        """STREAM_REQ from where the consumer stands, down every ROLLBACK to an OK."""
        for _ in range(20):
            v = self.views[vb]
            reply = await client.stream_request(
                vb, v.seqno, MAX_SEQNO, uuid=v.uuid, snap=v.request_snap(), opaque=vb + 1
            )
            if isinstance(reply, upr.StreamRequestRollback):
                to = reply.rollback_seqno
                assert to < v.seqno, f"vb {vb}: ROLLBACK to {to} from {v.seqno}"
                self.rollbacks.append((vb, v.seqno, to))
                v.rollback(to)
                continue
            if reply.status == Status.NOT_MY_VBUCKET:  # not yet opened by the ingest
                await trio.sleep(0.05)
                continue
            assert isinstance(reply, upr.StreamRequestOk), (vb, reply)
            # 3.0 sends a consumer of a history it does not know back to 0.
            known = {uuid for uuid, _ in reply.failover_log}
            assert v.seqno == 0 or v.uuid in known, (
                f"vb {vb}: streams from {v.seqno} of history {v.uuid}, not in {reply.failover_log}"
            )
            self.check_against(vb, view)
            v.failover = reply.failover_log
            if reply.failover_log:
                v.uuid = reply.failover_log[0][0]
            return
        raise AssertionError(f"vb {vb}: no stream after 20 requests")

    def _receive(self, vb: int, event: upr.UprEvent) -> None:
        v = self.views[vb]
        if isinstance(event, upr.SnapshotMarker):
            assert event.start_seqno <= event.end_seqno and event.end_seqno > v.seqno, (vb, event)
            v.snap = (event.start_seqno, event.end_seqno)
            return
        if not isinstance(event, upr.Mutation | upr.Deletion | upr.Expiration):
            return
        seqno = event.by_seqno
        assert seqno > v.seqno, f"vb {vb}: seqno {seqno} after {v.seqno}"
        assert v.snap[0] <= seqno <= v.snap[1], f"vb {vb}: seqno {seqno} outside {v.snap}"
        item = event_item(event)
        if self.unique_seqnos:
            before = self.served.setdefault((vb, seqno), item)
            assert before == item, f"vb {vb} seqno {seqno} served as {before}, now as {item}"
        v.items[seqno] = item
        v.seqno = seqno
        self.items_received += 1

    async def session(self, port: int, view: LogView | None) -> None:
        """Follow every vbucket until the connection breaks (the gateway died)."""
        try:
            client = await UprClient.connect(port)
        except OSError:
            return
        try:
            assert (await client.open(self.name)).status == 0
            for vb in self.views:
                await self._request(client, vb, view)
            self.sessions += 1
            self._changed()
            while True:
                event = await client.receive()
                await client.answer(event)
                if event.IS_RESPONSE or isinstance(event, upr.Noop):
                    continue
                vb = getattr(event, "opaque", 0) - 1
                if isinstance(event, upr.StreamEnd):
                    await self._request(client, vb, view)
                    continue
                self._receive(vb, event)
                self._changed()
        except (EOFError, trio.BrokenResourceError, OSError):
            return  # the gateway went away
        finally:
            await client.aclose()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def converged(self, store: Store) -> bool:
        return all(v.state() == store_state(store, vb) for vb, v in self.views.items())


def store_state(store: Store, vb: int) -> dict[bytes, tuple[int, bytes | None]]:
    """Per key (cas, value or None when deleted), as the node holds it."""
    return {
        it.key: (it.cas, None if it.kind is not ItemKind.MUTATION else it.value)
        for it in store.items_since(vb, 0)
    }


# -- the run ----------------------------------------------------------------------


@dataclass
class CrashSummary:
    seed: int
    kills: int = 0
    killed_listening: int = 0
    """Kills after the front announced its port (the others hit start-up)."""
    killed_stopping: int = 0
    """Kills after a SIGTERM (during the clean close, or after it)."""
    acked_checked: int = 0
    torn_bytes: int = 0
    rollbacks: int = 0
    items_received: int = 0
    written: int = 0


async def crash_run(
    tmp_path: Path,
    seed: int,
    kills: int,
    *,
    vbuckets: int = 4,
    initial_items: int = 2000,
    kill_after: tuple[float, float] = (0.0, 2.5),
) -> CrashSummary:
    """``kills`` SIGKILLs of ``serve`` at random moments, then a last run that must
    converge with the node (see the module docstring for what is checked)."""
    from gateway.io.listen import bound_port
    from gateway.node.server import Node, NodeConfig

    rng = random.Random(seed)
    summary = CrashSummary(seed)
    state_dir = tmp_path / "state"
    store = Store(vbuckets)
    writer = Writer(store, random.Random(rng.random()))
    writer.write(initial_items, time.time())
    consumer = Consumer(vbuckets)
    view: LogView | None = None
    async with trio.open_nursery() as nursery:
        node = Node(store, NodeConfig(vbuckets=vbuckets, checkpoint_interval=0.05))
        node_port = bound_port(await nursery.start(node.serve, "127.0.0.1", 0))
        nursery.start_soon(writer.run)

        async def follow(gateway: Gateway, view: LogView | None) -> None:
            await gateway.listening.wait()
            await consumer.session(gateway.port, view)

        for cycle in range(kills):
            async with trio.open_nursery() as running:
                fsync = rng.choice(FSYNC_MODES)
                gateway = await Gateway.start(running, node_port, state_dir, fsync=fsync)
                running.start_soon(follow, gateway, view)
                # The random moment of the kill: every other one while it starts (proving
                # and opening logs, the TAP CONNECT), the others once it serves.
                if rng.random() < 0.5:
                    await trio.sleep(rng.uniform(0.05, 1.5))
                else:
                    with trio.fail_after(60):
                        await gateway.listening.wait()
                    await trio.sleep(rng.uniform(*kill_after))
                    if rng.random() < 0.25:  # killed while it closes its logs on SIGTERM
                        gateway.proc.send_signal(signal.SIGTERM)
                        summary.killed_stopping += 1
                        await trio.sleep(rng.uniform(0.0, 0.3))
                summary.killed_listening += gateway.listening.is_set()
                gateway.kill()
                await gateway.exited.wait()
                running.cancel_scope.cancel()
            summary.kills += 1
            # Every ack the process sent has been read once the node saw the end.
            with trio.fail_after(20):
                while node.tap.holds(TAP_NAME):
                    await trio.sleep(0.01)
            registration = node.tap.registration(TAP_NAME)
            acked = (
                {vb: p.seqno for vb, p in registration.positions.items()} if registration else {}
            )
            wrong = private_state(state_dir) if state_dir.exists() else []
            assert not wrong, f"cycle {cycle}: state not private after SIGKILL: {wrong}"
            try:
                view = open_copy(state_dir, tmp_path / "copy")
            except AssertionError as exc:
                exc.add_note(f"cycle {cycle}, the killed run's log:\n{gateway.log_tail(60)}")
                shutil.copytree(state_dir, tmp_path / "kept")
                raise
            summary.torn_bytes += view.torn
            summary.acked_checked += check_acked_in_log(store, acked, view)
        # The last run: the writes stop and the consumer must reach the node's state.
        writer.scope.cancel()
        async with trio.open_nursery() as running:
            gateway = await Gateway.start(running, node_port, state_dir)
            sessions = consumer.sessions
            running.start_soon(follow, gateway, view)
            with trio.fail_after(60):
                await gateway.listening.wait()  # SIGTERM is handled from then on
                while consumer.sessions == sessions or not consumer.converged(store):
                    await consumer.changed.wait()
            wrong = private_state(state_dir)
            assert not wrong, f"state not private after a restart: {wrong}"
            status = await gateway.stop()
            assert status == 0, f"serve exited {status}:\n{gateway.log_tail()}"
            running.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    summary.rollbacks = len(consumer.rollbacks)
    summary.items_received = consumer.items_received
    summary.written = writer.written
    return summary
