"""Shape checks shared by the UPR decoders, and the errors they raise.

Every check names the opcode, the field and the offending value, with an
offset from the start of the packet (header included), and carries status
INVALID_ARGUMENTS: what a server answers to a malformed UPR packet.
"""

from __future__ import annotations

from collections.abc import Callable

from adapters.errors import ProtocolError
from adapters.mcbp.constants import HEADER_SIZE, Status
from adapters.mcbp.frames import Frame
from adapters.upr.dialect import Dialect
from adapters.upr.events import UprEvent

Decoder = Callable[[Frame], UprEvent]
DecoderBuilder = Callable[[Dialect, str], Decoder]
"""Makes the decoder of one command for one dialect; the str names the message."""

_INVALID = Status.INVALID_ARGUMENTS.value

# Whether a message has a key: must not, may, must.
NO, MAY, MUST = 0, 1, 2


def invalid(frame: Frame, reason: str, field: str, value: object, offset: int) -> ProtocolError:
    return ProtocolError(
        reason, opcode=frame.opcode, field=field, value=value, offset=offset, status=_INVALID
    )


def bad_extras(frame: Frame, what: str, sizes: str) -> ProtocolError:
    return invalid(
        frame, f"{what} extras must be {sizes} bytes", "extras_length", frame.extras_length, 4
    )


def check(frame: Frame, what: str, extras: int, key: int, value: bool, key_field: str) -> None:
    """The shape rules of a message: extras size, key presence, value presence."""
    if frame.extras_length != extras:
        raise bad_extras(frame, what, str(extras))
    if key == MUST and not frame.key_length:
        raise invalid(frame, f"{what} requires a non-empty {key_field}", key_field, 0, 2)
    if key == NO and frame.key_length:
        raise invalid(frame, f"{what} must not have a key", "key_length", frame.key_length, 2)
    used = extras + frame.key_length
    if not value and len(frame.body) != used:
        raise invalid(
            frame, f"{what} must not have a value", "value", frame.body[used:], HEADER_SIZE + used
        )


def meta_overrun(frame: Frame, nmeta: int, at: int) -> ProtocolError:
    return invalid(
        frame, "nmeta is longer than what follows the key", "nmeta", nmeta, HEADER_SIZE + at
    )
