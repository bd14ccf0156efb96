"""UPR response events.

A response that carries data has a class of its own (``StreamRequestOk``,
``StreamRequestRollback``, ``FailoverLogResponse``, ``AddStreamResponse``);
every other response, including a failed STREAM_REQ or GET_FAILOVER_LOG, is
the generic ``Response`` naming the ``Command`` it answers. Classes whose
status is implied by their kind expose ``status`` as a read-only property, so
an event can never claim a status its wire form would contradict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from adapters.mcbp.constants import Status
from adapters.upr.constants import Command
from adapters.upr.failover import FailoverEntries


@dataclass(frozen=True, slots=True)
class StreamRequestOk:
    """STREAM_REQ accepted: the producer's failover log for the vbucket."""

    NAME: ClassVar[str] = "STREAM_REQ"
    IS_RESPONSE: ClassVar[bool] = True
    COMMAND: ClassVar[Command] = Command.STREAM_REQ
    failover_log: FailoverEntries = ()
    opaque: int = 0

    @property
    def status(self) -> int:
        return Status.SUCCESS.value


@dataclass(frozen=True, slots=True)
class StreamRequestRollback:
    """STREAM_REQ refused with status 0x23: roll back to ``rollback_seqno`` first."""

    NAME: ClassVar[str] = "STREAM_REQ"
    IS_RESPONSE: ClassVar[bool] = True
    COMMAND: ClassVar[Command] = Command.STREAM_REQ
    rollback_seqno: int = 0
    opaque: int = 0

    @property
    def status(self) -> int:
        return Status.ROLLBACK.value


@dataclass(frozen=True, slots=True)
class FailoverLogResponse:
    """Successful GET_FAILOVER_LOG."""

    NAME: ClassVar[str] = "GET_FAILOVER_LOG"
    IS_RESPONSE: ClassVar[bool] = True
    COMMAND: ClassVar[Command] = Command.GET_FAILOVER_LOG
    failover_log: FailoverEntries = ()
    opaque: int = 0

    @property
    def status(self) -> int:
        return Status.SUCCESS.value


@dataclass(frozen=True, slots=True)
class AddStreamResponse:
    """Consumer's answer to ADD_STREAM: the opaque its stream will use."""

    NAME: ClassVar[str] = "ADD_STREAM"
    IS_RESPONSE: ClassVar[bool] = True
    COMMAND: ClassVar[Command] = Command.ADD_STREAM
    stream_opaque: int = 0
    opaque: int = 0
    status: int = 0


@dataclass(frozen=True, slots=True)
class Response:
    """Any other response: the command it answers, a status and optional text."""

    NAME: ClassVar[str] = "RESPONSE"
    IS_RESPONSE: ClassVar[bool] = True
    command: Command
    opaque: int = 0
    status: int = 0
    value: bytes = b""
