"""A UPR consumer's handshake with a producer, without I/O.

Theory of operation. Before any stream, a consumer OPENs a producer
connection and sets it up with CONTROLs, one request at a time, each
answered before the next goes (nothing else flows yet).
``ConsumerHandshake`` is that sequence for the TAP front's upstream
connections and for ``capture``: ``next_request()`` gives the next
request's bytes (None once done), ``receive(event)`` takes what came back
and tells whether it answered the current request; the I/O side only
sends, reads and hands over.

The steps, in order (a dialect without OPEN, the pre-release draft, has
none; one without CONTROL stops after the OPEN):

- OPEN with the producer flag (and the caller's other flags), under the
  connection's name: a refusal ends the handshake (``HandshakeRefused``);
- CONTROL ``enable_expiry_opcode`` ``true`` when asked for: a server
  without the opcode refuses it, which is noted (``granted``), not fatal;
- CONTROL ``connection_buffer_size`` when a buffer is announced: a refusal
  ends the handshake (the consumer's memory is bounded by that buffer);
- then ``enable_noop`` ``true`` and ``set_noop_interval`` when NOOPs are
  asked for: a refusal is noted (``noops``), not fatal. A 3.0 consumer takes
  any answer to a CONTROL and goes on (ep-engine 3.0 upr-consumer.cc
  ``UprConsumer::handleResponse``: a CONTROL response is ENGINE_SUCCESS
  whatever its status); without NOOPs the producer never drops the
  connection for an unanswered one, and a dead one is seen when it closes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from adapters.errors import GatewayError
from adapters.mcbp import Status
from adapters.mcbp.constants import status_name
from adapters.upr.codec import encode
from adapters.upr.constants import Command, OpenFlags
from adapters.upr.dialect import Dialect
from adapters.upr.events import Control, Open, UprEvent, UprRequest


class HandshakeRefused(GatewayError):
    """The producer refused a request the consumer cannot do without."""


@dataclass(frozen=True)
class Step:
    request: UprRequest
    what: str
    """How a refusal names it."""
    required: bool = True


class ConsumerHandshake:
    """One consumer connection's set-up requests (see the module docstring)."""

    def __init__(
        self,
        dialect: Dialect,
        name: bytes,
        *,
        flags: OpenFlags = OpenFlags.PRODUCER,
        expiry_opcode: bool = False,
        buffer_size: int | None = None,
        noop_interval: int | None = None,
    ) -> None:
        self.dialect = dialect
        steps: list[Step] = []
        if Command.OPEN in dialect.opcodes:
            open_ = Open(name=name, flags=flags | OpenFlags.PRODUCER)
            steps.append(Step(open_, "OPEN of a producer connection"))
        if steps and Command.CONTROL in dialect.opcodes:
            if expiry_opcode:
                steps.append(_control(b"enable_expiry_opcode", b"true", required=False))
            if buffer_size is not None:
                steps.append(_control(b"connection_buffer_size", b"%d" % buffer_size))
            if noop_interval is not None:
                steps.append(_control(b"enable_noop", b"true", required=False))
                steps.append(_control(b"set_noop_interval", b"%d" % noop_interval, required=False))
        self._steps = steps
        self._buffer_size = buffer_size
        self._current: Step | None = None
        self._opaque = 0
        self.granted: dict[str, bool] = {}
        """Each step answered so far, by its ``what``: whether the producer granted it."""

    @property
    def opaque(self) -> int:
        """The last opaque the handshake used (later requests may go on from it)."""
        return self._opaque

    @property
    def buffer_size(self) -> int:
        """The flow-control buffer the producer accepted (0: none)."""
        granted = self.granted.get("CONTROL connection_buffer_size", False)
        return self._buffer_size if granted and self._buffer_size else 0

    @property
    def noops(self) -> bool:
        """Whether the producer agreed to send NOOPs (``enable_noop`` granted)."""
        return self.granted.get("CONTROL enable_noop", False)

    def next_request(self) -> bytes | None:
        """The next request to send (once the previous one was answered); None: done."""
        if self._current is not None:
            raise RuntimeError("the previous handshake request is not answered yet")
        if not self._steps:
            return None
        step = self._steps.pop(0)
        self._opaque += 1
        self._current = step
        return encode(dataclasses.replace(step.request, opaque=self._opaque), self.dialect)

    def receive(self, event: UprEvent) -> bool:
        """Whether ``event`` answered the current request; raises ``HandshakeRefused``
        when the producer refused one the consumer needs."""
        step = self._current
        if step is None or not event.IS_RESPONSE or event.opaque != self._opaque:
            return False  # nothing else should flow yet: ignored
        self._current = None
        status = getattr(event, "status", Status.SUCCESS)
        self.granted[step.what] = status == Status.SUCCESS
        if status != Status.SUCCESS and step.required:
            text = getattr(event, "value", b"").decode("utf-8", "replace")
            raise HandshakeRefused(
                f"{step.what} refused: {status_name(status)} (0x{status:02x})"
                + (f": {text}" if text else "")
            )
        return True


def _control(key: bytes, value: bytes, *, required: bool = True) -> Step:
    return Step(Control(key=key, value=value), f"CONTROL {key.decode()}", required)
