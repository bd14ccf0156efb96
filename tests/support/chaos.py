"""Seeded randomized fault runs over real processes.

The chain: a reference node process (``node --data-dir``) is both upstreams of
one ``serve`` process (its TAP for the UPR front, its UPR for the TAP front),
each link through a ``Relay``; the UPR consumers (``ChaosConsumer``, the
project's client; ``RawConsumer``, raw frames) and the TAP clients (one
registered, one backfilling on every connection) reach ``serve`` through relays
too. A writer loads sets, deletes and short TTLs into the node while faults hit
at random moments (see ``FAULTS``). Then the faults stop, everything comes
back, and the run waits until every consumer and client holds the node's data.

Checked during the run: a consumer that resumes with its last seqno, snapshot
and uuid is answered from a history it knows or rolled back below its seqno;
seqnos grow within each stream and sit in their snapshot; a (vbucket, seqno) is
never served as two items (the front's by_seqnos are never reused). At the end:
every consumer's and client's live keys equal the node's; no process logged a
traceback or a line that is not one whole log line; ``serve`` exited 0 when
asked to stop and otherwise only when killed; a byte flipped in a closed
segment got its vbucket set aside (``set-aside/``); ``serve``'s RSS stayed
bounded.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from adapters.tap import ConnectFlags
from gateway.fronts.upr.proof import prove_vbucket
from tests.support.chaos_net import (
    NODE_LISTENING,
    TAP_LISTENING,
    UPR_LISTENING,
    Proc,
    Relay,
    fsize_limit,
    log_problems,
    node_command,
    serve_command,
)
from tests.support.chaos_peers import (
    ChaosConsumer,
    ChaosTapClient,
    NodeWriter,
    Port,
    RawConsumer,
    State,
    bad_input,
    node_state,
    send_bad_input,
)

FAULTS = (
    "kill_serve",
    "stop_serve",
    "term_serve",
    "kill_node",
    "stop_node",
    "cut",
    "truncate",
    "stall",
    "consumer_stops_reading",
    "fsize_limit",
    "flip_byte",
    "bad_peer",
)
FSYNC = ("batch", "batch", "always", "never")
RSS_LIMIT_KIB = 400 * 1024


@dataclass
class ChaosSummary:
    seed: int
    faults: dict[str, int] = field(default_factory=dict)
    written: int = 0
    upr_items: int = 0
    raw_items: int = 0
    rollbacks: int = 0
    tap_connections: int = 0
    tap_refused: int = 0
    set_aside: int = 0
    keys: int = 0
    max_rss_kib: int = 0


class ChaosRun:
    def __init__(self, tmp: Path, seed: int, vbuckets: int = 4) -> None:
        self.tmp = tmp
        self.seed = seed
        self.rng = random.Random(seed)
        self.vbuckets = vbuckets
        self.summary = ChaosSummary(seed)
        self.state_dir = tmp / "state"
        self.data_dir = tmp / "node"
        self.relays = {n: Relay(n) for n in ("tap_up", "upr_up", "upr_front", "tap_front")}
        self.node_port = Port()
        self.procs: list[Proc] = []
        self.node: Proc | None = None
        self.serve: Proc | None = None
        self.flipped = 0
        self.flips: list[str | None] = []
        self.consumer = ChaosConsumer(vbuckets, b"chaos-consumer")
        self.raw = RawConsumer(Port(), vbuckets)
        self.taps = [
            ChaosTapClient(Port(), b"chaos-reg", _tap_flags(True), registered=True),
            ChaosTapClient(Port(), b"chaos-fresh", _tap_flags(False), registered=False),
        ]
        self.writer = NodeWriter(self.node_port, vbuckets, random.Random(self.rng.random()))
        self._restart = trio.Lock()

    def say(self, what: str) -> None:
        if os.environ.get("CHAOS_TRACE"):
            print(f"{trio.current_time():.2f} {what}", flush=True)

    def _count(self, fault: str) -> None:
        self.summary.faults[fault] = self.summary.faults.get(fault, 0) + 1

    # -- processes --------------------------------------------------------------

    async def start_node(self, nursery: trio.Nursery) -> None:
        fsync = self.rng.choice(("batch", "always"))
        cmd = node_command(self.data_dir, self.vbuckets, fsync)
        self.node = await Proc.start(nursery, "node", cmd, [NODE_LISTENING])
        self.procs.append(self.node)
        await self.node.wait_listening(60)
        self.say("node listening")
        self.node_port.port = self.node.ports[0]
        self.relays["tap_up"].target = self.node_port.port
        self.relays["upr_up"].target = self.node_port.port

    async def start_serve(self, nursery: trio.Nursery, *, limit: int | None = None) -> None:
        self.relays["upr_front"].target = None
        self.relays["tap_front"].target = None
        cmd = serve_command(
            self.state_dir,
            self.relays["tap_up"].port,
            self.relays["upr_up"].port,
            self.rng.choice(FSYNC),
        )
        preexec = fsize_limit(limit) if limit is not None else None
        self.serve = await Proc.start(
            nursery, "serve", cmd, [UPR_LISTENING, TAP_LISTENING], preexec=preexec
        )
        self.procs.append(self.serve)
        await self.serve.wait_listening(60)
        self.relays["upr_front"].target = self.serve.ports[0]
        self.relays["tap_front"].target = self.serve.ports[1]

    def serve_rss(self) -> None:
        if self.serve is not None:
            rss = self.serve.rss_kib()
            self.summary.max_rss_kib = max(self.summary.max_rss_kib, rss)

    # -- faults -------------------------------------------------------------------

    async def fault(self, nursery: trio.Nursery, name: str) -> None:
        rng = self.rng
        self._count(name)
        self.say(f"fault {name}")
        if name in ("kill_serve", "term_serve", "fsize_limit", "flip_byte"):
            async with self._restart:
                assert self.serve is not None
                self.serve_rss()
                if name == "term_serve":
                    status = await self.serve.stop()
                    assert status == 0, (
                        f"serve exited {status} on SIGTERM:\n{self.serve.log_tail()}"
                    )
                else:
                    await self.serve.kill()
                if name == "flip_byte":
                    flipped = flip_closed_segment_byte(self.state_dir, rng)
                    self.say(f"flipped {flipped}")
                    self.flipped += flipped is not None
                    self.flips.append(flipped)
                limit = rng.randint(2048, 24 * 1024) if name == "fsize_limit" else None
                if limit is None:
                    await self.start_serve(self.outer)
                    return
                try:
                    await self.start_serve(self.outer, limit=limit)
                except AssertionError:
                    # A log that cannot record its new history stops the start, in one
                    # line naming the state directory (exit 1); any other exit fails.
                    last = self.serve.lines[-1] if self.serve.lines else ""
                    if not (self.serve.proc.returncode == 1 and "--state-dir" in last):
                        raise
                    self.serve.refused_start = True
                    self._count("fsize_limit_refused_start")
                else:
                    # Runs a while with writes failing (EFBIG), then comes back whole.
                    await trio.sleep(rng.uniform(0.3, 2.0))
                    await self.serve.kill()
                await self.start_serve(self.outer)
        elif name == "kill_node":
            async with self._restart:
                assert self.node is not None
                await self.node.kill()
                self.say("node killed")
                self.relays["tap_up"].target = self.relays["upr_up"].target = None
                await trio.sleep(rng.uniform(0.0, 0.5))
                await self.start_node(self.outer)
        elif name in ("stop_serve", "stop_node"):
            proc = self.serve if name == "stop_serve" else self.node
            assert proc is not None
            proc.signal(signal.SIGSTOP)
            await trio.sleep(rng.uniform(0.1, 4.0))  # past NOOP intervals at times
            proc.signal(signal.SIGCONT)
        elif name == "cut":
            rng.choice(list(self.relays.values())).cut()
        elif name == "truncate":
            rng.choice(list(self.relays.values())).truncate_next(rng.random())
        elif name == "stall":
            relay = rng.choice(list(self.relays.values()))
            nursery.start_soon(relay.stall, rng.uniform(0.1, 2.0))
        elif name == "bad_peer":
            upr_front = rng.random() < 0.5
            front = self.relays["upr_front" if upr_front else "tap_front"]
            nursery.start_soon(send_bad_input, front.port, bad_input(rng, upr_front))
        elif name == "consumer_stops_reading":
            nursery.start_soon(self.raw.pause, rng.uniform(0.2, 3.0))
        else:
            raise AssertionError(name)

    async def faults(self, nursery: trio.Nursery, count: int, gap: tuple[float, float]) -> None:
        for _ in range(count):
            await trio.sleep(self.rng.uniform(*gap))
            name = self.rng.choice(FAULTS)
            # Overlapping faults: some run alongside the next ones.
            if self.rng.random() < 0.3 and name not in ("fsize_limit", "flip_byte"):
                nursery.start_soon(self.fault, nursery, name)
            else:
                await self.fault(nursery, name)
            self.serve_rss()

    # -- the run --------------------------------------------------------------------

    async def run(
        self, faults: int, gap: tuple[float, float] = (0.2, 1.2), max_ttl: int = 3
    ) -> ChaosSummary:
        self.writer.max_ttl = max_ttl
        async with trio.open_nursery() as nursery:
            self.outer = nursery
            for relay in self.relays.values():
                await nursery.start(relay.serve)
            self.raw.port.port = self.relays["upr_front"].port
            for tap in self.taps:
                tap.port.port = self.relays["tap_front"].port
            await self.start_node(nursery)
            await self.start_serve(nursery)
            async with trio.open_nursery() as load:
                load.start_soon(self.writer.run)
                load.start_soon(self.consumer.run, Port(self.relays["upr_front"].port))
                load.start_soon(self.raw.run)
                for tap in self.taps:
                    load.start_soon(tap.run)
                async with trio.open_nursery() as chaos:
                    await self.faults(chaos, faults, gap)  # the overlapping ones end too
                await self._settle(nursery, load)
                load.cancel_scope.cancel()
            await self._finish()
            nursery.cancel_scope.cancel()
        return self.summary

    async def _settle(self, nursery: trio.Nursery, load: trio.Nursery) -> None:
        """Stop the writes, bring everything back, wait for every peer to hold the node's
        data (reading the node again each time: its pager expires TTLs meanwhile)."""
        for relay in self.relays.values():
            relay._flowing.set()
        self.raw.reading.set()
        assert self.node is not None and self.serve is not None
        for proc in (self.node, self.serve):
            assert proc.alive, f"{proc.name} died unasked:\n{proc.log_tail()}"
        self.node.signal(signal.SIGCONT)
        self.serve.signal(signal.SIGCONT)
        self.writer.scope.cancel()
        peers: list[tuple[str, Callable[[], State]]] = [
            ("UPR consumer", self.consumer.live),
            ("raw UPR consumer", self.raw.live),
            *((f"TAP client {t.name.decode()}", t.live) for t in self.taps),
        ]
        self.say("settling")
        audits = 0
        want: State = {}
        try:
            with trio.fail_after(90):
                while True:
                    audits += 1
                    want = await node_state(
                        self.node_port.port, self.vbuckets, b"audit-%d" % audits
                    )
                    if all(live() == want for _, live in peers):
                        break
                    await trio.sleep(0.2)
        except trio.TooSlowError:
            raise AssertionError(self._differences(want, peers)) from None
        self.summary.keys = len(want)

    def _differences(self, want: State, peers: list[tuple[str, Callable[[], State]]]) -> str:
        lines = [f"seed {self.seed}: peers did not reach the node's {len(want)} live keys"]
        for name, live in peers:
            got = live()
            missing = sorted(k for k in want if k not in got)
            extra = sorted(k for k in got if k not in want)
            wrong = sorted(k for k in want if k in got and got[k] != want[k])
            if missing or extra or wrong:
                lines.append(
                    f"  {name}: missing {missing[:5]} ({len(missing)}), extra {extra[:5]} "
                    f"({len(extra)}), different {[(k, got[k][0], want[k][0]) for k in wrong[:5]]} "
                    f"({len(wrong)})"
                )
        assert self.serve is not None
        lines.append("serve's log tail:\n" + self.serve.log_tail(60))
        return "\n".join(lines)

    async def _finish(self) -> None:
        assert self.serve is not None and self.node is not None
        self.serve_rss()
        self.say("stopping")
        status = await self.serve.stop()
        assert status == 0, f"serve exited {status} on SIGTERM:\n{self.serve.log_tail()}"
        status = await self.node.stop()
        assert status == 0, f"node exited {status} on SIGTERM:\n{self.node.log_tail()}"
        for proc in self.procs:
            await proc.exited.wait()
            code = proc.proc.returncode
            killed = code == -signal.SIGKILL and signal.SIGKILL in proc.signalled
            refused = code == 1 and proc.refused_start
            assert code == 0 or killed or refused, f"{proc.name} exited {code}:\n{proc.log_tail()}"
        self.say("checking logs")
        problems = [line for proc in self.procs for line in log_problems(proc)]
        assert not problems, "log lines that break the rules:\n" + "\n".join(problems[:40])
        set_aside = self.state_dir / "set-aside"
        self.summary.set_aside = len(os.listdir(set_aside)) if set_aside.exists() else 0
        said = [line for p in self.procs for line in p.lines if "set aside" in line]
        assert self.summary.set_aside >= self.flipped, (
            f"{self.flipped} segments damaged while serve was down ({self.flips}), "
            f"{self.summary.set_aside} logs set aside:\n" + "\n".join(said)
        )
        assert self.summary.max_rss_kib < RSS_LIMIT_KIB, self.summary.max_rss_kib
        self.summary.written = self.writer.written
        self.summary.upr_items = self.consumer.items_received
        self.summary.raw_items = self.raw.items
        self.summary.rollbacks = len(self.consumer.rollbacks) + self.raw.rollbacks
        self.summary.tap_connections = sum(t.connections for t in self.taps)
        self.summary.tap_refused = sum(t.refused for t in self.taps)


def _tap_flags(checkpoint: bool) -> ConnectFlags:
    flags = ConnectFlags.BACKFILL | ConnectFlags.SUPPORT_ACK
    return flags | ConnectFlags.CHECKPOINT if checkpoint else flags


def flip_closed_segment_byte(state_dir: Path, rng: random.Random) -> str | None:
    """Flip one byte of a segment that is not its log's last (a closed one); which."""
    closed = []
    for vb_dir in sorted(state_dir.glob("vb-*")):
        # The segments the next start reads (not the leftovers a compaction covers,
        # which it deletes), but the last, whose end may be a torn tail.
        proof = prove_vbucket(vb_dir, int(vb_dir.name[3:]))
        if not proof.problems:
            closed += [s.path for s in proof.segments[:-1] if s.size > 0]
    if not closed:
        return None
    path = rng.choice(closed)
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"{path.relative_to(state_dir)} byte {at} of {len(data)}"
