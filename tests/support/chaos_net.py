"""Real processes and a faulty network for the chaos runs (``tests/support/chaos.py``).

``Relay`` is a byte relay on a loopback port that stays put while the process
behind it is restarted on another port; it can cut every connection, cut one
half way through the bytes it is forwarding (a frame cut short on the wire),
or stall for a while. ``Proc`` runs one of our commands as a process, keeps
its stderr lines and the ports its listening lines name.
"""

from __future__ import annotations

import re
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import trio

from gateway.io.listen import bound_port
from tests.support.crash_harness import SERVE as TUNED_SERVE

NODE_LISTENING = r"reference node listening on 127\.0\.0\.1:(\d+)"
UPR_LISTENING = r"UPR front listening on 127\.0\.0\.1:(\d+)"
TAP_LISTENING = r"TAP front listening on 127\.0\.0\.1:(\d+)"

SERVE = TUNED_SERVE
"""``serve`` with the UPR front's compaction and segment roll made frequent, so faults
land on them too."""


class Relay:
    """A TCP relay from a fixed loopback port to ``target`` (None: refuse)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.target: int | None = None
        self.port = 0
        self.cuts = 0
        self.truncations = 0
        self.stalls = 0
        self._scopes: list[trio.CancelScope] = []
        self._flowing = trio.Event()
        self._flowing.set()
        self._truncate: float | None = None
        """Set: the next chunk from the server side is forwarded up to this fraction, then
        every connection is cut."""

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = bound_port(listeners)
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            await trio.serve_listeners(self._relay, listeners, handler_nursery=nursery)

    async def _relay(self, client: trio.SocketStream) -> None:
        scope = trio.CancelScope()
        self._scopes.append(scope)
        try:
            with scope:
                if self.target is None:
                    await client.aclose()
                    return
                try:
                    server = await trio.open_tcp_stream("127.0.0.1", self.target)
                except OSError:
                    await client.aclose()
                    return
                async with client, server, trio.open_nursery() as pair:
                    pair.start_soon(self._pump, client, server, pair.cancel_scope, False)
                    pair.start_soon(self._pump, server, client, pair.cancel_scope, True)
        finally:
            if scope in self._scopes:
                self._scopes.remove(scope)

    async def _pump(
        self,
        src: trio.SocketStream,
        dst: trio.SocketStream,
        scope: trio.CancelScope,
        from_server: bool,
    ) -> None:
        try:
            while data := await src.receive_some(65536):
                await self._flowing.wait()
                if from_server and self._truncate is not None and len(data) > 1:
                    part, self._truncate = self._truncate, None
                    await dst.send_all(data[: max(1, int(len(data) * part))])
                    self.truncations += 1
                    self.cut()
                    return
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        scope.cancel()

    def cut(self) -> None:
        self.cuts += 1
        scopes, self._scopes = self._scopes, []
        for scope in scopes:
            scope.cancel()

    def truncate_next(self, fraction: float) -> None:
        self._truncate = fraction

    async def stall(self, seconds: float) -> None:
        self.stalls += 1
        if self._flowing.is_set():  # else an overlapping stall holds it already
            self._flowing = trio.Event()
        held = self._flowing
        try:
            await trio.sleep(seconds)
        finally:
            held.set()


def fsize_limit(limit: int) -> Callable[[], None]:
    """A preexec_fn: writes past ``limit`` bytes of a file fail with EFBIG (not SIGXFSZ)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


class Proc:
    """One process of ours; its stderr lines in ``lines``, the ports of its listening lines."""

    def __init__(self, name: str, proc: trio.Process, patterns: list[str]) -> None:
        self.name = name
        self.proc = proc
        self.patterns = [re.compile(p) for p in patterns]
        self.ports: dict[int, int] = {}
        self.lines: list[str] = []
        self.listening = trio.Event()
        self.exited = trio.Event()
        self.signalled: set[int] = set()
        """Signals sent to it (a status other than 0 is fine only after SIGKILL)."""
        self.refused_start = False
        """It stopped at start-up, exit 1, on a state directory it could not write."""

    @classmethod
    async def start(
        cls,
        nursery: trio.Nursery,
        name: str,
        command: list[str],
        patterns: list[str],
        preexec: Callable[[], None] | None = None,
    ) -> Proc:
        proc = await trio.lowlevel.open_process(command, stderr=-1, preexec_fn=preexec)
        running = cls(name, proc, patterns)
        nursery.start_soon(running._read_log)
        return running

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
                    for n, pattern in enumerate(self.patterns):
                        found = pattern.search(line)
                        if found:
                            self.ports[n] = int(found.group(1))
                    if len(self.ports) == len(self.patterns):
                        self.listening.set()
            if pending:
                self.lines.append(pending.decode("utf-8", "replace"))
        except trio.Cancelled:
            self.signal(signal.SIGKILL)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self.proc.wait()
            self.exited.set()

    async def wait_listening(self, timeout: float) -> None:
        """Until every listening line came; fails at once if the process exits first."""
        async with trio.open_nursery() as waiting:

            async def exited() -> None:
                await self.exited.wait()
                raise AssertionError(
                    f"{self.name} exited {self.proc.returncode} before listening:\n"
                    + self.log_tail()
                )

            waiting.start_soon(exited)
            with trio.fail_after(timeout):
                await self.listening.wait()
            waiting.cancel_scope.cancel()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.signalled.add(sig)
            self.proc.send_signal(sig)

    async def kill(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process dies as well, but say so
        self.signal(signal.SIGKILL)
        await self.exited.wait()

    async def stop(self) -> int:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        await self.exited.wait()
        return self.proc.returncode if self.proc.returncode is not None else -1

    def rss_kib(self) -> int:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return 0
        found = re.search(r"VmRSS:\s+(\d+) kB", status)
        return int(found.group(1)) if found else 0

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


def node_command(data_dir: Path, vbuckets: int, fsync: str) -> list[str]:
    return [sys.executable, "-m", "gateway", "node", "--listen", "127.0.0.1:0",
            "--vbucket-count", str(vbuckets), "--data-dir", str(data_dir),
            "--fsync", fsync]  # fmt: skip


def serve_command(
    state_dir: Path,
    tap_upstream: int,
    upr_upstream: int,
    fsync: str,
    *,
    compact_interval: float = 0.5,
    segment_bytes: int = 16 * 1024,
) -> list[str]:
    return [sys.executable, "-c", SERVE, str(compact_interval), str(segment_bytes),
            "--tap-upstream", f"127.0.0.1:{tap_upstream}", "--upr-listen", "127.0.0.1:0",
            "--upr-upstream", f"127.0.0.1:{upr_upstream}", "--tap-listen", "127.0.0.1:0",
            "--upstream-noop-interval", "2",
            "--no-metrics", "--state-dir", str(state_dir), "--fsync", fsync]  # fmt: skip


TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+[+-]\d\d:\d\d [A-Z]+ ")


def log_problems(proc: Proc) -> list[str]:
    """Lines of ``proc``'s log that break the rules: a traceback, or a line that is not
    one whole log line (an error spread over several lines)."""
    bad = []
    for line in proc.lines:
        if "Traceback" in line or not TIMESTAMP.match(line):
            bad.append(f"{proc.name}: {line}")
    return bad
