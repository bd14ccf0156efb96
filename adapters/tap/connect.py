"""What a TAP CONNECT asks for, read the same way by every TAP producer here.

``connect_refusal`` builds the error a producer answers a CONNECT it cannot
honour with (NOT_SUPPORTED, naming the field); ``listed_vbuckets`` checks the
flags and says whether the client named its vbuckets; ``ConnectView`` gives
a plan that keeps the flags the questions producers ask of them.
"""

from __future__ import annotations

from adapters.errors import ProtocolError
from adapters.mcbp.constants import Status
from adapters.tap.constants import ConnectFlags, TapOpcode

KNOWN_FLAGS = ConnectFlags(0x1FF)


def connect_refusal(reason: str, *, field: str, value: object) -> ProtocolError:
    return ProtocolError(
        reason, opcode=TapOpcode.CONNECT, field=field, value=value, status=Status.NOT_SUPPORTED
    )


def listed_vbuckets(flags: ConnectFlags) -> bool:
    """Whether the client lists its vbuckets; refuses unknown flags and a takeover
    that does not say which vbuckets it takes over."""
    unknown = int(flags) & ~int(KNOWN_FLAGS)
    if unknown:
        raise connect_refusal("unsupported TAP connect flags", field="flags", value=unknown)
    listed = bool(flags & ConnectFlags.LIST_VBUCKETS)
    if flags & ConnectFlags.TAKEOVER_VBUCKETS and not listed:
        raise connect_refusal(
            "TAKEOVER_VBUCKETS needs LIST_VBUCKETS", field="flags", value=int(flags)
        )
    return listed


class ConnectView:
    """Questions about the CONNECT flags, for plan classes that keep them as ``flags``."""

    __slots__ = ()
    flags: ConnectFlags

    def has(self, flag: ConnectFlags) -> bool:
        return bool(self.flags & flag)

    @property
    def support_ack(self) -> bool:
        return self.has(ConnectFlags.SUPPORT_ACK)

    @property
    def dump(self) -> bool:
        return self.has(ConnectFlags.DUMP)

    @property
    def takeover(self) -> bool:
        return self.has(ConnectFlags.TAKEOVER_VBUCKETS)

    @property
    def registered(self) -> bool:
        return self.has(ConnectFlags.REGISTERED_CLIENT)
