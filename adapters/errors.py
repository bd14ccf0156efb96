"""The project's error types.

``ProtocolError`` is the only exception a decoder or state machine raises on
bad input; anything else escaping from ``adapters`` is a bug.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose."""


class ProtocolError(GatewayError):
    """A peer sent something the protocol does not allow.

    Carries what was wrong so the message can name it, and the memcached
    status to answer with where the protocol has one (``None``: just close).
    """

    def __init__(
        self,
        reason: str,
        *,
        opcode: int | None = None,
        field: str | None = None,
        value: Any = None,
        offset: int | None = None,
        status: int | None = None,
    ) -> None:
        self.reason = reason
        self.opcode = opcode
        self.field = field
        self.value = value
        self.offset = offset
        self.status = status
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.reason]
        if self.opcode is not None:
            parts.append(f"opcode=0x{self.opcode:02x}")
        if self.field is not None:
            parts.append(f"field={self.field}")
        if self.value is not None:
            parts.append(f"value={_show(self.value)}")
        if self.offset is not None:
            parts.append(f"offset={self.offset}")
        return " ".join(parts)

    def at(self, offset: int) -> ProtocolError:
        """The same error, placed at ``offset`` bytes into a stream."""
        return ProtocolError(
            self.reason,
            opcode=self.opcode,
            field=self.field,
            value=self.value,
            offset=offset if self.offset is None else offset + self.offset,
            status=self.status,
        )


class LocalProtocolError(GatewayError):
    """We were asked to send something the protocol or state forbids (our bug or misuse)."""


def _show(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        return "0x" + raw[:32].hex() + ("..." if len(raw) > 32 else "")
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value} (0x{value:x})"
    return repr(value)
