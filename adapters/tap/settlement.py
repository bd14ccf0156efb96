"""What a TAP acknowledgement settles, when a front forwards an upstream's stream.

Theory of operation. A front that serves TAP from an upstream owes the
upstream two things for what it forwarded, flow-control credit (the bytes it
may send again) and the replies it waits for (SET_VBUCKET_STATE, snapshot
markers that asked for an ack), and owes itself the positions the TAP peer
reached (a registered client resumes from them). None of them is final until
the TAP peer has the messages. ``Settlement`` gathers them for one batch;
``Settlements.end`` attaches it to the batch's last stamped message when the
peer acks (support-ack) and messages are in flight, or makes it ready at once
(without support-ack the producer keeps nothing, so a message handed to the
socket counts as delivered).

Acks are cumulative (``adapters.tap.producer``: an ack of sequence number N
releases N and everything sent before it), so an ack releases every
settlement held on a message up to it, oldest first; the acks of one read
release them together (``combined``: one upstream send). A busy nack
releases nothing (the producer backs off and resends); any other nack is
the producer's fatal error.

Generations: the front counts its upstream connections (``new_upstream``).
Credit and replies are owed to the connection they were gathered on, so a
settlement made for an older one settles the TAP side (positions) only;
``owed_upstream`` tells which.

Sans-IO: the caller stamps messages with its ``TapProducer``, hands what the
peer answers to ``acked``/``answered``, and sends what a released settlement
carries. The reference node's TAP producer settles a registered client's
positions the same way (it has no upstream: positions only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from adapters.tap.producer import SEQNO_MODULUS, TapProducer

__all__ = ["Settlement", "Settlements", "Settling"]

P = TypeVar("P")
P_co = TypeVar("P_co", covariant=True)


class _LastSeqno(Protocol):
    @property
    def last_seqno(self) -> int: ...


class Settling(Protocol[P_co]):
    """A vbucket stream whose position a settlement takes when it closes."""

    @property
    def translator(self) -> _LastSeqno: ...

    def position(self) -> P_co: ...


@dataclass
class Settlement(Generic[P]):
    """What becomes final once a TAP message is acknowledged (see the module docstring)."""

    generation: int = 0
    credit: int = 0
    replies: list[bytes] = field(default_factory=list)
    touched: dict[int, Settling[P]] = field(default_factory=dict)
    """Streams that sent messages in it; their positions are taken when it closes."""
    positions: dict[int, P] = field(default_factory=dict)
    """A registered client's positions reached (its registry keeps them)."""
    seqnos: dict[int, int] = field(default_factory=dict)
    """Another client's: the seqno reached is all its acks settle."""
    arrival: float = 0.0
    """Wall-clock arrival of the oldest upstream item in it (0: none)."""

    def merge(self, other: Settlement[P]) -> None:
        if other.generation == self.generation:
            self.credit += other.credit
            self.replies.extend(other.replies)
        self.positions.update(other.positions)
        self.seqnos.update(other.seqnos)
        if other.arrival and not self.arrival:
            self.arrival = other.arrival

    def close(self, generation: int, registered: bool) -> None:
        """Take the positions of the streams touched (``registered``: whole positions,
        else the seqnos: a position per vbucket and batch cost more than the rest
        of a live batch's bookkeeping)."""
        self.generation = generation
        if registered:
            for vbucket, stream in self.touched.items():
                self.positions[vbucket] = stream.position()
        else:
            seqnos = self.seqnos
            for vbucket, stream in self.touched.items():
                seqnos[vbucket] = stream.translator.last_seqno
        self.touched.clear()

    @property
    def empty(self) -> bool:
        return not (self.credit or self.replies or self.positions or self.seqnos)


class Settlements(Generic[P]):
    """The settlements of one TAP connection: the one being gathered, those held on
    unacked messages, and those ready to settle (see the module docstring)."""

    def __init__(self, producer: TapProducer, *, support_ack: bool, registered: bool) -> None:
        self.producer = producer
        # Asked once per batch and per ack: plain bools, not Flag arithmetic.
        self._support_ack = support_ack
        self._registered = registered
        self.generation = 0
        """Counts upstream connections: see ``owed_upstream``."""
        self.settling: Settlement[P] = Settlement()
        """What the batch being built will settle (replaced at each ``end``)."""
        self._pending: dict[int, Settlement[P]] = {}
        """By the sequence number of the message each waits on, in stamping order."""
        self._ready: list[Settlement[P]] = []
        self.last_acked = 0
        """The sequence number of the last message an ack released (0: none yet)."""

    def new_upstream(self) -> None:
        """A new upstream connection: what was gathered for the last one settles the
        TAP side only."""
        self.generation += 1

    def owed_upstream(self, settlement: Settlement[P]) -> bool:
        """Whether ``settlement``'s credit and replies go to the current upstream."""
        return settlement.generation == self.generation

    def end(self) -> None:
        """Attach what was gathered to the last message stamped (or make it ready)."""
        settlement, self.settling = self.settling, Settlement(self.generation)
        settlement.close(self.generation, self._registered)
        if settlement.empty:
            return
        producer = self.producer
        last = producer.last_opaque
        if self._support_ack and last and producer.unacked:
            held = self._pending.get(last)
            if held is None:
                self._pending[last] = settlement
            else:
                held.merge(settlement)
        else:
            self._ready.append(settlement)

    def take_ready(self) -> list[Settlement[P]]:
        """The settlements that need no ack, in the order they were made."""
        ready, self._ready = self._ready, []
        return ready

    def acked(self, opaques: list[int]) -> list[Settlement[P]]:
        """Apply the successful acks of one read, in order (``opaques`` is emptied);
        the settlements they released, oldest first."""
        producer = self.producer
        first = producer.first_unacked
        count = producer.release_acks(opaques)
        opaques.clear()
        return self._released(first, count)

    def answered(
        self, opaque: int, status: int, now: float, text: bytes, opcode: int
    ) -> list[Settlement[P]]:
        """Apply one ack or nack (``TapProducer.release``, which raises for a refusal);
        the settlements it released, oldest first."""
        producer = self.producer
        first = producer.first_unacked
        count = producer.release(opaque, status, now, text, opcode)
        return self._released(first, count)

    def _released(self, first: int, count: int) -> list[Settlement[P]]:
        """The settlements held on the ``count`` messages acked from ``first`` on."""
        released: list[Settlement[P]] = []
        if count:
            # Sequence numbers run 1 .. SEQNO_MODULUS, then 1 again.
            self.last_acked = (first + count - 2) % SEQNO_MODULUS + 1
        pending = self._pending
        # Settlements wait in the order of their messages' sequence numbers.
        while count and pending:
            opaque = next(iter(pending))
            if (opaque - first) % SEQNO_MODULUS >= count:
                break
            released.append(pending.pop(opaque))
        return released

    def combined(self, settlements: list[Settlement[P]]) -> Settlement[P]:
        """One settlement of what ``settlements`` carry (credit and replies of the
        current upstream only), for one upstream send; its arrival is left out."""
        batch: Settlement[P] = Settlement(self.generation)
        for settlement in settlements:
            batch.merge(settlement)
        batch.arrival = 0.0
        return batch

    def oldest_arrival(self) -> float:
        """The arrival of the oldest upstream item not yet acked (0: none)."""
        # Held in the order they were made, so the first with an arrival is the
        # oldest (a scan of all of them on every ack was quadratic).
        return next((s.arrival for s in self._pending.values() if s.arrival), 0.0)
