"""What every UPR producer connection here does alike: the node's and the UPR front's.

Theory of operation. The protocol decisions of a producer connection live in
the sans-IO ``adapters.upr.producer_machine.ProducerMachine`` (CONTROL, the
flow-control window, NOOP liveness, the stream table, what each request
does); ``UprProducerBase`` only moves bytes and events between it and the
connection, in one nursery:

- the reader (``run``'s own task) hands each frame to the machine and acts
  on what comes back, in order, through ``_OUTPUTS`` (one method per output
  class): replies are queued, memcached's own commands go to the listener's
  command door (``answer``), wanted streams and failover logs to the
  subclass, replies a stream waits for to that stream; a malformed request
  is answered, then the connection closes (``ProtocolError``);
- the timer task sleeps until ``next_deadline()`` (or a CONTROL changed the
  NOOP settings) and sends what ``on_timer`` gives: a NOOP, or the end of a
  connection whose consumer stopped answering them;
- the subclass's stream tasks, which count their writes in ``window`` and
  wait in ``_wait_for_room``, the one wait for room in the window: every
  stream blocked on a full window waits on one event, set whenever the
  machine says the window may have room (a buffer ack, a new buffer size).

Subclasses answer ``_stream_request`` (after the machine's checks; they call
``machine.add_stream`` when they start one) and ``_failover_log``, and hear
of what they also track (``_on_decode_error``, ``_on_buffer_size``,
``_on_expiry_opcode``, ``_on_acknowledged``, ``_on_unblocked``).
``connection_stats`` is the one ``STAT dcp`` answer of a producer
connection; subclasses give its counts (``_stat_counts``) and their
streams' lines (``_stream_stats``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Generic

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.upr import producer_machine as pm
from adapters.upr.flow_control import ProducerWindow
from adapters.upr.producer_machine import ProducerMachine, S
from gateway.io.connection import PacketConnection
from gateway.io.door import Answer, refuse_command

log = logging.getLogger(__name__)


class UprProducerBase(Generic[S]):
    def __init__(
        self,
        conn: PacketConnection,
        name: str,
        dialect: upr.Dialect,
        noop_interval: float,
        *,
        delete_times: bool = False,
        serves: Callable[[int], bool] = lambda _vb: True,
        high_seqno: Callable[[int], int] | None = None,
        backfilling: Callable[[int], bool] = lambda _vb: False,
        notifier: bool = False,
        answer: Answer = refuse_command,
    ) -> None:
        self.conn = conn
        self.name = name
        self.dialect = dialect
        self.answer = answer
        """Answers the requests that are not UPR's (the listener's ``Door.answer``)."""
        self.machine: ProducerMachine[S] = ProducerMachine(
            name,
            dialect,
            noop_interval=noop_interval,
            delete_times=delete_times,
            serves=serves,
            admission=self._admission,
            notifier=notifier,
            high_seqno=high_seqno,
            backfilling=backfilling,
        )
        self.window: ProducerWindow = self.machine.window
        self.streams: dict[int, S] = self.machine.streams
        """By vbucket (the machine's table): each with ``opaque``, ``live``, ``on_response``."""
        self._room = trio.Event()
        self._timers_changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._stat_prefix = ""
        """Before every stat name (the node's hub adds the connection's name itself)."""

    @property
    def noop_enabled(self) -> bool:
        return self.machine.noop_enabled

    @property
    def noop_interval(self) -> float:
        return self.machine.noop_interval

    @property
    def expiry_opcode(self) -> bool:
        return self.machine.expiry_opcode

    # -- running ---------------------------------------------------------------

    async def run(self, first: upr.UprEvent | None) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._timer_loop)
            if first is not None:
                await self.handle(first)
            conn, machine = self.conn, self.machine
            while (frame := await conn.receive_frame()) is not None:
                for output in machine.receive_frame(frame, trio.current_time()):
                    await _OUTPUTS[type(output)](self, output)
            # The consumer went away: nobody is left to stream to.
            nursery.cancel_scope.cancel()

    async def handle(self, event: upr.UprEvent) -> None:
        """Act on one decoded event (the first request, handed over by the door)."""
        for output in self.machine.receive(event, trio.current_time()):
            await _OUTPUTS[type(output)](self, output)

    async def _timer_loop(self) -> None:
        machine = self.machine
        while True:
            self._timers_changed = trio.Event()
            deadline = machine.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timers_changed.wait()
                continue  # the settings changed: ask again
            noop = machine.on_timer(trio.current_time())
            if noop:
                await self.conn.send(noop)

    def _admission(self, what: str) -> str | None:
        authority = self.conn.authority
        if authority is None or authority.may_administer():
            return None
        return authority.refuse_admin(what)

    # -- acting on the machine's outputs -----------------------------------------

    async def _reply(self, output: pm.Reply) -> None:
        await self.conn.send(output.data)

    async def _command(self, output: pm.McCommand) -> None:
        await self.answer(self.conn, output.frame)  # memcached's own commands

    async def _stream_wanted(self, output: pm.StreamWanted) -> None:
        await self._stream_request(output.request)

    async def _log_wanted(self, output: pm.LogWanted) -> None:
        await self._failover_log(output.request)

    async def _end_stream(self, output: pm.EndStream) -> None:
        output.stream.close_by_consumer()  # dead before the answer that follows

    async def _deliver(self, output: pm.Deliver) -> None:
        output.stream.on_response(output.response)

    async def _applied(self, output: pm.Applied) -> None:
        _APPLIED[output.key](self, output.value)

    async def _room_again(self, _output: pm.Room) -> None:
        self._on_acknowledged()
        self._room.set()

    async def _fail(self, output: pm.Fail) -> None:
        self._on_decode_error(output.error)
        raise output.error

    # -- what subclasses provide -----------------------------------------------

    async def _stream_request(self, req: upr.StreamRequest) -> None:
        raise NotImplementedError

    async def _failover_log(self, req: upr.GetFailoverLog) -> None:
        raise NotImplementedError

    def _on_decode_error(self, exc: ProtocolError) -> None:
        """A request did not decode (counted by subclasses that keep statistics)."""

    def _on_buffer_size(self, size: int) -> None:
        """CONTROL connection_buffer_size was applied."""

    def _on_expiry_opcode(self, enabled: bool) -> None:
        """CONTROL enable_expiry_opcode was applied."""

    def _on_acknowledged(self) -> None:
        """The window may have room again (a BUFFER_ACKNOWLEDGEMENT was credited)."""

    def _on_unblocked(self, seconds: float) -> None:
        """A stream waited ``seconds`` for room in the window."""

    def _on_noop_settings(self) -> None:
        self._timers_changed.set()  # the timer task asks for the new deadline

    # -- sending ---------------------------------------------------------------

    async def respond(self, event: upr.UprEvent) -> None:
        await self.conn.send(upr.encode(event, self.dialect))

    async def _refuse(self, event: upr.UprEvent, status: int, text: str) -> None:
        command = getattr(event, "COMMAND", upr.Command.OPEN)
        await self.respond(upr.Response(command, event.opaque, status, text.encode()))

    async def _wait_for_room(self) -> None:
        """Wait while the flow-control window is full (every blocked stream on one
        event, which any credit sets; each then checks the window again)."""
        window = self.window
        if window.can_send:
            return
        blocked_at = trio.current_time()
        while not window.can_send:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()
        self._on_unblocked(trio.current_time() - blocked_at)
        # A stream woken by a credit after its scope was cancelled (CLOSE_STREAM
        # read meanwhile) sends nothing more: 3.0 ``closeStream`` answers last.
        await trio.lowlevel.checkpoint_if_cancelled()

    # -- statistics ------------------------------------------------------------

    def connection_stats(self) -> list[tuple[str, str]]:
        """The connection's lines of ``STAT dcp`` (ep-engine 3.0's names), then its
        streams', each name after ``_stat_prefix``."""
        window = self.window
        items_sent, items_remaining, bytes_sent = self._stat_counts()
        values: list[tuple[str, object]] = [
            # 3.0 ``UprProducer::getType``: a notifier says so.
            ("type", "notifier" if self.machine.notifier else "producer"),
            ("items_sent", items_sent),
            ("items_remaining", items_remaining),
            ("total_bytes_sent", bytes_sent),
            ("unacked_bytes", window.unacked_bytes),
            ("total_acked_bytes", window.total_acked),
            ("max_buffer_bytes", window.buffer_size or 0),
            ("flow_control", "enabled" if window.enabled else "disabled"),
            ("paused", _flag(not window.can_send)),
            ("noop_enabled", _flag(self.noop_enabled)),
            ("noop_interval", f"{self.noop_interval:g}"),
            ("enable_expiry_opcode", _flag(self.expiry_opcode)),
            ("num_streams", len(self.streams)),
        ]
        prefix = self._stat_prefix
        out = [(prefix + name, str(value)) for name, value in values]
        out.extend(self._stream_stats(prefix))
        return out

    def _stat_counts(self) -> tuple[int, int, int]:
        """Items sent, items still to send, bytes sent."""
        raise NotImplementedError

    def _stream_stats(self, prefix: str) -> list[tuple[str, str]]:
        """Every stream's lines, in vbucket order."""
        raise NotImplementedError


def _flag(value: bool) -> str:
    return "true" if value else "false"


_OUTPUTS: dict[type, Callable[[UprProducerBase[Any], Any], Awaitable[None]]] = {
    pm.Reply: UprProducerBase._reply,
    pm.McCommand: UprProducerBase._command,
    pm.StreamWanted: UprProducerBase._stream_wanted,
    pm.LogWanted: UprProducerBase._log_wanted,
    pm.EndStream: UprProducerBase._end_stream,
    pm.Deliver: UprProducerBase._deliver,
    pm.Applied: UprProducerBase._applied,
    pm.Room: UprProducerBase._room_again,
    pm.Fail: UprProducerBase._fail,
}
"""What the I/O side does for each output of the machine."""

_APPLIED: dict[bytes, Callable[[UprProducerBase[Any], Any], None]] = {
    # Through the instance, so a subclass's hook is the one called.
    b"connection_buffer_size": lambda producer, size: producer._on_buffer_size(size),
    b"enable_expiry_opcode": lambda producer, flag: producer._on_expiry_opcode(flag),
    b"enable_noop": lambda producer, _on: producer._on_noop_settings(),
    b"set_noop_interval": lambda producer, _interval: producer._on_noop_settings(),
}
"""Who hears of each CONTROL setting the machine applied."""
