"""The receiving end of a TAP stream, as a 2.x replica applies one.

Theory of operation. A connection whose first stream message is a TAP
message (not CONNECT) is a sender pushing a stream into this node: the
destination of a 2.x vbucket move, where ns_server's ebucketmigrator relays
the source's TAP stream here unchanged. ``receive_tap_stream`` applies each
message to the store in arrival order:

- MUTATION / DELETE: replicated writes with the source's CAS, rev_seqno,
  flags and expiration (``apply_mutation`` / ``apply_deletion``); item
  flags without the TAP flag NETWORK_BYTE_ORDER arrive byte-swapped (2.x
  host order) and are swapped back. Where they may land is the store's
  call: it refuses DEAD vbuckets;
- OPAQUE(INITIAL_VBUCKET_STREAM): the vbucket is reset to empty before its
  backfill (refused on an ACTIVE or DEAD vbucket, whose data it would
  destroy), and STREAM_REQs for it are TMPFAIL (``backfill``) until the
  first CHECKPOINT_START of an id over 0, or until it becomes ACTIVE: 3.0
  resets it as a new non-active vbucket, whose open checkpoint id is 0
  (src/ep.cc ``setVBucketState``), until the sender's id arrives (src/
  tapconnection.cc ``processCheckpointCommand``) or ``VBucket::setState``
  makes it active (id 2). CLOSE_TAP_STREAM is acked and the sender then
  closes; the other opaque codes only announce the sender's features;
- VBUCKET_SET: the vbucket takes the state (pending, then active at the end
  of a takeover);
- CHECKPOINT_START/END: the vbucket's checkpoints follow the sender's ids,
  so a later CONNECT can resume from this node's last closed checkpoint.

What the sender's packets ask for (acks, NOOPs, an expired TTL, a CONNECT
or an unknown opcode, an OPAQUE of the wrong size) is the TAP consumer
machine's call (``adapters.tap.consumer_machine``, not ``dialed``: it goes
on after an expired TTL's nack and ignores stray responses); this module
applies what it says to apply. A message the store refuses gets a nack,
asked for or not, with the store's status and text, and the stream goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableSet
from typing import Any

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Status
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlags,
    TapFlush,
    TapMutation,
    TapOpaque,
    TapStreamMessage,
    TapVbucketSet,
)
from adapters.tap.consumer_machine import Decision, Do, TapConsumerMachine
from adapters.tap.item_messages import stored_flags
from gateway.io.connection import PacketConnection
from gateway.io.replies import send_refusal
from gateway.node.items import StoreError, VBucketState

log = logging.getLogger(__name__)

_NO_RESET_STATES = (VBucketState.ACTIVE, VBucketState.DEAD)


async def receive_tap_stream(node: Any, conn: PacketConnection, first: Frame) -> None:
    """Apply the TAP stream arriving on ``conn``, starting with ``first``."""
    conn.reader.lenient_responses = True  # a TAP peer's responses: body length frames them
    receiver = TapReceiver(node.store, node.upr.initial_backfill, peer=conn.name)
    frame: Frame | None = first
    while frame is not None:
        try:
            reply = receiver.handle(frame)
        except _Refused as exc:
            await send_refusal(conn, exc.reply)
            raise
        if reply:
            await conn.send(reply)
        frame = await conn.receive_frame()
    log.info("%s: TAP sender closed after %d messages", conn.name, receiver.applied)


class TapReceiver:
    """Applies decoded TAP messages to ``store``; ``handle`` returns the reply bytes."""

    def __init__(
        self, store: Any, backfill: MutableSet[int] | None = None, *, peer: str = "TAP sender"
    ) -> None:
        self.store = store
        self.machine = TapConsumerMachine(peer, dialed=False, backfill=backfill)
        self.backfill = self.machine.backfill
        """Vbuckets between INITIAL_VBUCKET_STREAM and their first checkpoint."""
        self.applied = 0

    @property
    def nacks(self) -> int:
        return self.machine.nacks

    @property
    def closing(self) -> bool:
        """OPAQUE(CLOSE_TAP_STREAM) arrived: the sender is done."""
        return self.machine.closing

    def handle(self, frame: Frame) -> bytes:
        """The reply to one packet; raises (the connection closes) when it is refused."""
        return self._act(self.machine.receive_frame(frame))

    def receive(self, message: TapStreamMessage) -> bytes:
        """Apply one stream message; the ack, the nack or nothing."""
        return self._act(self.machine.receive(message))

    def _act(self, decision: Decision) -> bytes:
        if decision.note is not None:
            log.log(logging.getLevelName(decision.note.level.upper()), decision.note.text)
        return _ACT[decision.do](self, decision)

    def _apply_decided(self, decision: Decision) -> bytes:
        message = decision.message
        try:
            self._apply(message)
        except StoreError as exc:
            log.info("TAP %s into vbucket %d refused: %s", message.NAME, message.vbucket, exc)
            return self.machine.nack(message, exc.status, exc.message)
        self.machine.applied(message)
        self.applied += 1
        return decision.reply

    def _reply(self, decision: Decision) -> bytes:
        return decision.reply

    def _close(self, decision: Decision) -> bytes:
        assert decision.error is not None
        if not decision.reply:
            raise decision.error
        raise _Refused(decision.reply, decision.error)

    def _apply(self, message: TapStreamMessage) -> None:
        _APPLY[type(message)](self, message, time.time())

    def _deletion(self, message: TapDelete, now: float) -> None:
        rev_seqno = self._rev(message)
        self.store.apply_deletion(
            message.vbucket, message.key, cas=message.cas, rev_seqno=rev_seqno, now=now
        )

    def _vbucket_set(self, message: TapVbucketSet, now: float) -> None:
        self.store.set_state(message.vbucket, message.state, now=now)

    def _checkpoint_start(self, message: TapCheckpointStart, _now: float) -> None:
        vb = message.vbucket
        if self.store.checkpoints(vb)[-1].id < message.checkpoint_id:
            self.store.close_checkpoint(vb, next_id=message.checkpoint_id)

    def _checkpoint_end(self, message: TapCheckpointEnd, _now: float) -> None:
        vb = message.vbucket
        if self.store.checkpoints(vb)[-1].id == message.checkpoint_id:
            self.store.close_checkpoint(vb)

    def _flush(self, _message: TapFlush, _now: float) -> None:
        # 2.x flushed the whole bucket; a node sharing vbuckets must not.
        raise StoreError(Status.NOT_SUPPORTED, "TAP FLUSH is not supported")

    def _mutation(self, message: TapMutation, now: float) -> None:
        if message.tap_flags & TapFlags.NO_VALUE:
            raise StoreError(Status.NOT_SUPPORTED, "a keys-only mutation cannot be applied")
        self.store.apply_mutation(
            message.vbucket,
            message.key,
            message.value,
            flags=stored_flags(message),
            expiration=message.expiration,
            cas=message.cas,
            rev_seqno=self._rev(message),
            datatype=message.datatype,
            now=now,
        )

    def _rev(self, message: TapMutation | TapDelete) -> int:
        if message.rev_seqno is not None:
            return message.rev_seqno
        # A sender without 2.x metadata: the next revision of what is here.
        old = self.store.lookup(message.vbucket, message.key)
        return old.rev_seqno + 1 if old is not None else 1

    def _opaque(self, message: TapOpaque, _now: float) -> None:
        vb = message.vbucket
        if message.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM:
            state = self.store.state(vb)
            if state in _NO_RESET_STATES:
                why = f"will not reset vbucket {vb}: it is {state.name.lower()}"
                raise StoreError(Status.NOT_MY_VBUCKET, why)
            self.store.reset_vbucket(vb)


_Apply = Callable[[TapReceiver, Any, float], None]
_APPLY: dict[type, _Apply] = {
    TapMutation: TapReceiver._mutation,
    TapDelete: TapReceiver._deletion,
    TapOpaque: TapReceiver._opaque,
    TapVbucketSet: TapReceiver._vbucket_set,
    TapCheckpointStart: TapReceiver._checkpoint_start,
    TapCheckpointEnd: TapReceiver._checkpoint_end,
    TapFlush: TapReceiver._flush,
}
"""What each stream message does to the store (the one table)."""

_ACT: dict[Do, Callable[[TapReceiver, Decision], bytes]] = {
    Do.APPLY: TapReceiver._apply_decided,
    Do.SKIP: TapReceiver._reply,
    Do.ANSWER: TapReceiver._reply,
    Do.NACK: TapReceiver._reply,
    Do.IGNORE: TapReceiver._reply,
    Do.CLOSE: TapReceiver._close,
}
"""What the receiver does for each of the machine's decisions."""


class _Refused(ProtocolError):
    """A packet refused with ``reply``, after which the connection closes."""

    def __init__(self, reply: bytes, cause: ProtocolError) -> None:
        super().__init__(
            cause.reason,
            opcode=cause.opcode,
            field=cause.field,
            value=cause.value,
            offset=cause.offset,
            status=cause.status,
        )
        self.reply = reply
