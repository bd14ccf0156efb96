"""UPR flow control, both ends.

Theory of operation. A consumer announces ``connection_buffer_size`` with
CONTROL. The producer counts every stream message it sends at its whole size
on the wire (header included) and stops once the unacknowledged total reaches
the buffer size; the consumer, as it processes messages, sends
BUFFER_ACKNOWLEDGEMENT with the bytes it freed, after about 20% of the buffer
or every few seconds, whichever comes first. NOOPs and responses are not
counted: they are connection housekeeping, not stream data.

Real clients hung by acknowledging the wrong count or by forgetting snapshot
markers, so both classes here work from wire sizes only and count every
stream message the same way.
"""

from __future__ import annotations

COUNTED_MESSAGES = frozenset(
    {
        "MUTATION",
        "DELETION",
        "EXPIRATION",
        "SNAPSHOT_MARKER",
        "STREAM_END",
        "SET_VBUCKET_STATE",
        "FLUSH",
        "STREAM_START",
        "SNAPSHOT_START",
        "SNAPSHOT_END",
    }
)
"""Names (``event.NAME``) of the producer's requests that flow control counts."""

BUFFER_ACK_OPCODE = 0x5D
DEFAULT_ACK_FRACTION = 0.2
DEFAULT_ACK_SECONDS = 5.0


def is_counted(name: str, is_response: bool) -> bool:
    return not is_response and name in COUNTED_MESSAGES


def counts(event: object) -> bool:
    """Whether flow control counts ``event`` (stream data, not housekeeping): by class."""
    return type(event) in COUNTED_CLASSES


class ConsumerWindow:
    """The consumer's count of counted bytes received and not yet acknowledged.

    For a consumer that acknowledges what it freed as it frees it (the TAP
    front returns what its own peer acked, end to end); ``ConsumerAcker``
    instead batches a consumer's acks by size and time.
    """

    __slots__ = ("buffer_size", "unacked_bytes")

    def __init__(self, buffer_size: int = 0) -> None:
        self.buffer_size = buffer_size
        """What the producer accepted in CONTROL connection_buffer_size (0: no flow control)."""
        self.unacked_bytes = 0

    @property
    def full(self) -> bool:
        """The producer has stopped: its window is used up."""
        return 0 < self.buffer_size <= self.unacked_bytes

    def release(self, size: int) -> int:
        """``size`` bytes freed: the BUFFER_ACKNOWLEDGEMENT to send (0: none), never
        more than is outstanding and nothing without flow control."""
        if size <= 0 or not self.buffer_size:
            return 0
        size = min(size, self.unacked_bytes)
        self.unacked_bytes -= size
        return size


class ProducerWindow:
    """The producer's count of bytes the consumer has not yet acknowledged."""

    __slots__ = ("buffer_size", "total_acked", "total_sent", "unacked_bytes")

    def __init__(self, buffer_size: int | None = None) -> None:
        self.buffer_size = buffer_size
        self.unacked_bytes = 0
        self.total_sent = 0
        self.total_acked = 0

    @property
    def enabled(self) -> bool:
        return self.buffer_size is not None

    def set_buffer_size(self, size: int) -> None:
        """CONTROL connection_buffer_size; 0 turns flow control off."""
        self.buffer_size = size or None

    @property
    def can_send(self) -> bool:
        return self.buffer_size is None or self.unacked_bytes < self.buffer_size

    @property
    def room(self) -> int | None:
        """Bytes that may still be sent before the window is full (None: unlimited)."""
        if self.buffer_size is None:
            return None
        return max(0, self.buffer_size - self.unacked_bytes)

    def sent(self, size: int) -> None:
        self.unacked_bytes += size
        self.total_sent += size

    def acknowledged(self, size: int) -> None:
        """BUFFER_ACKNOWLEDGEMENT from the consumer.

        More than is outstanding leaves nothing outstanding: ep-engine 3.0
        (upr-producer.cc, ``BufferLog::free``) clamps at zero and neither
        answers nor disconnects. ``total_acked`` counts only what was freed.
        """
        freed = min(size, self.unacked_bytes)
        self.unacked_bytes -= freed
        self.total_acked += freed


class ConsumerAcker:
    """The consumer's side: when to send BUFFER_ACKNOWLEDGEMENT, and for how much."""

    __slots__ = ("_last_ack", "buffer_size", "freed", "seconds", "threshold")

    def __init__(
        self,
        buffer_size: int,
        *,
        fraction: float = DEFAULT_ACK_FRACTION,
        seconds: float = DEFAULT_ACK_SECONDS,
        now: float = 0.0,
    ) -> None:
        if buffer_size <= 0:
            raise ValueError("buffer_size must be positive")
        self.buffer_size = buffer_size
        self.threshold = max(1, int(buffer_size * fraction))
        self.seconds = seconds
        self.freed = 0
        self._last_ack = now

    def processed(self, size: int, now: float) -> int:
        """Account a processed message; return bytes to acknowledge now (0: not yet)."""
        self.freed += size
        if self.freed >= self.threshold or now - self._last_ack >= self.seconds:
            return self._take(now)
        return 0

    def due(self, now: float) -> int:
        """Timer check: bytes to acknowledge because time passed (0: nothing due)."""
        if self.freed and now - self._last_ack >= self.seconds:
            return self._take(now)
        return 0

    def _take(self, now: float) -> int:
        freed, self.freed = self.freed, 0
        self._last_ack = now
        return freed


def _counted_classes() -> frozenset[type]:
    from adapters.upr.events import REQUEST_CLASSES

    return frozenset(cls for cls in REQUEST_CLASSES.values() if cls.NAME in COUNTED_MESSAGES)


COUNTED_CLASSES = _counted_classes()
"""The stream messages flow control counts, by class (``COUNTED_MESSAGES``)."""
