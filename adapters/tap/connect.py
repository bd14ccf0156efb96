"""What a TAP CONNECT asks for, read the same way by every TAP producer here.

``connect_refusal`` builds the error a producer answers a CONNECT it cannot
honour with (NOT_SUPPORTED, naming the field); ``listed_vbuckets`` says
whether the client named its vbuckets; ``ConnectView`` gives a plan that
keeps the flags the questions producers ask of them.

As ep-engine 2.x read a CONNECT (ep_engine.cc, ``createTapQueue``; the
filter is ``VBucketFilter`` in vbucket.hh):

- flag bits it does not know are ignored, not refused, and so are bytes
  after the options it knows;
- LIST_VBUCKETS with a count of 0 is an empty filter, and an empty filter
  accepts every vbucket: the same as no list at all;
- the CHECKPOINT map and the REGISTERED_CLIENT byte may be left out.
"""

from __future__ import annotations

from adapters.errors import ProtocolError
from adapters.mcbp.constants import Status
from adapters.tap.constants import ConnectFlags, TapOpcode
from adapters.tap.events import TapConnect


def connect_refusal(reason: str, *, field: str, value: object) -> ProtocolError:
    return ProtocolError(
        reason, opcode=TapOpcode.CONNECT, field=field, value=value, status=Status.NOT_SUPPORTED
    )


def listed_vbuckets(connect: TapConnect) -> bool:
    """Whether the client names its vbuckets (a list of none means all of them);
    refuses a takeover that does not say which vbuckets it takes over."""
    flags = connect.connect_flags
    listed = bool(flags & ConnectFlags.LIST_VBUCKETS) and bool(connect.vbuckets)
    if flags & ConnectFlags.TAKEOVER_VBUCKETS and not listed:
        raise connect_refusal(
            "TAKEOVER_VBUCKETS needs a LIST_VBUCKETS list", field="flags", value=int(flags)
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
