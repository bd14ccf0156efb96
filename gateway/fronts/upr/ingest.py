"""The upstream side of the UPR front: one TAP connection into the durable log.

Theory of operation. ``Ingest.run`` keeps one TAP connection to the upstream
node for the whole gateway, whatever the number of consumers:

1. connect (SASL PLAIN first when configured) and learn the vbuckets:
   ``STAT vbucket`` for their states, ``STAT vbucket-seqno`` as the list
   when the node has no state group; every active one unless configured;
2. CONNECT as the registered client ``tap_name`` with backfill (everything),
   list vbuckets, support ack, checkpoint (each vbucket's last closed TAP
   checkpoint id from the log) and network byte order flags. The node
   resumes a registered client where its acks left off, else by checkpoint,
   else it backfills from scratch (the log then reconciles);
3. stream in batches: every frame one read brought is applied to the logs'
   buffers; the touched logs are written, published to the consumers
   (with fsync "batch" before the fsync, see ``commit``), fsynced per the
   policy (off the trio loop, several files at once), and only then are the
   TAP messages that asked for an ack acknowledged, in one write. A crash
   therefore never loses what the node considers delivered.
   With fsync "batch" or "never" the commits are pipelined with the reading
   (``commit.GroupCommit``): while one commit's fsyncs run, the next reads
   are applied, and the next commit covers them all. Fsync "always" and a
   takeover connection commit each batch (or item) before reading on.

Any failure (refused connect, lost connection, malformed packet) closes the
connection and retries with exponential backoff; each retry resumes as in 2.
A log write that fails (a full disk, a file-size limit) leaves the log as
it was and fails the batch: nothing of it is acked, the error is logged,
and the connection is retried with backoff; the node sends the unacked
messages again and the log writes the records it still holds.

Re-fetch. TAP has no per-vbucket rewind: a registered client resumes each
vbucket where its acks left off, and a CONNECT without a checkpoint id for
a vbucket still resumes from the client's cursor there (ep-engine's
``TapProducer::registerCursor``). So when a vbucket cannot be resumed (its
reconcile was interrupted by a crash, or its log was set aside and must be
fetched whole again, ``VbLog.needs_refetch``), the ingest deregisters its
name first (DEREGISTER_TAP_CLIENT drops every cursor and position) and
names for that vbucket a checkpoint no node holds: the node backfills it
from date 0 (left out, a 2.5.1 node would stream it from checkpoint 1), while
the other vbuckets resume by their checkpoints or are reconciled.

Takeover requests from consumer streams go through ``takeover``: a
connection of its own per vbucket, whose VBUCKET_SET messages are held,
unacked, until the consumer has answered the matching SET_VBUCKET_STATE.
A vbucket handed over (``handed_over``) is left out of every CONNECT.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import NoReturn

import trio

from adapters.errors import GatewayError
from adapters.mcbp import Frame, FrameReader, Opcode
from adapters.mcbp.constants import VBucketState
from adapters.tap import (
    ConnectFlags,
    TapConnect,
    TapDelete,
    TapFlush,
    TapMutation,
    TapOpaque,
    TapStreamMessage,
    TapVbucketSet,
    encode,
)
from adapters.tap.consumer_machine import Decision, Do, TapConsumerMachine
from adapters.translate.tap_to_log_fast import frame_end, log_buffer
from gateway.fronts.upr.commit import GroupCommit, commit
from gateway.fronts.upr.config import UprFrontConfig
from gateway.fronts.upr.logset import LogSet
from gateway.fronts.upr.vblog import LogWriteError, VbLog
from gateway.io.connection import PacketConnection
from gateway.metrics.figures import GatewayStats
from gateway.runtime.logs import Repeats, describe
from gateway.runtime.write_failures import errno_name
from gateway.tools.capture.mapping import TapRecording

log = logging.getLogger(__name__)

__all__ = ["Ingest", "TapUpstreamError", "commit"]

RECEIVE_SIZE = 256 * 1024
STEP_FRAMES = 512
"""Frames applied in one step of the trio loop at most (when commits are pipelined)."""
CONNECT_FLAGS = (
    ConnectFlags.BACKFILL
    | ConnectFlags.LIST_VBUCKETS
    | ConnectFlags.SUPPORT_ACK
    | ConnectFlags.CHECKPOINT
    | ConnectFlags.REGISTERED_CLIENT
    | ConnectFlags.FIX_FLAG_BYTEORDER
)
NO_SUCH_CHECKPOINT = 2**63 - 1
"""The last closed checkpoint named for a vbucket to fetch whole (see ``connect_event``)."""

StateHook = Callable[[int, VBucketState], Awaitable[None]]
"""Called with a VBUCKET_SET before it is acked (takeover hand-off)."""


class TapUpstreamError(GatewayError):
    """The TAP upstream refused or broke the stream."""


class _Batch:
    """What one batch of frames answers, and the logs it touched."""

    __slots__ = ("acks", "messages", "replies", "touched")

    def __init__(self) -> None:
        self.messages = 0
        self.replies: list[bytes] = []
        self.acks: list[bytes] = []
        self.touched: dict[int, VbLog] = {}


def _first_error(errors: BaseExceptionGroup[BaseException]) -> BaseException:
    """The failed log write among ``errors`` if any, else the first error (the reader's
    and the committer's task fail together: one cancels the other)."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [errors]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending[0:0] = error.exceptions
        else:
            leaves.append(error)
    for error in leaves:
        if isinstance(error, LogWriteError):
            return error
    return leaves[0]


async def _let_serve() -> None:
    """Two more yields after a read that kept up was published (fsync batch), before
    the next read is applied: a connection's serving task the publish woke takes two
    rounds of the loop to send (it yields once more before its pass), and trio orders
    each round at random, so with the one yield of the next ``receive_some`` the
    next read was applied first most of the time (an item waited for the whole next
    read; first in, first out is the lower latency). A read of ``STEP_FRAMES``
    frames or more (the ingest is behind) goes on without them, as before: bigger
    serving batches cost less per item while it catches up."""
    await trio.lowlevel.checkpoint()
    await trio.lowlevel.checkpoint()


def _cannot_resume(vblog: VbLog) -> bool:
    """The vbucket must be backfilled whole: an interrupted reconcile, or a re-fetch."""
    return vblog.translator.reset_interrupted or vblog.needs_refetch


class Ingest:
    def __init__(
        self,
        config: UprFrontConfig,
        logs: LogSet,
        stats: GatewayStats,
        *,
        name: str | None = None,
        vbuckets: tuple[int, ...] | None = None,
        takeover: bool = False,
        state_hook: StateHook | None = None,
        recording: TapRecording | None = None,
        handed_over: Collection[int] = frozenset(),
    ) -> None:
        self.config = config
        self.logs = logs
        self.stats = stats
        self.name = name or config.tap_name
        self.vbuckets = vbuckets if vbuckets is not None else config.vbuckets
        self.takeover = takeover
        self.state_hook = state_hook
        self.recording = recording
        """Records every message received from the upstream (``capture_dir``)."""
        self.handed_over = handed_over
        """Vbuckets handed over to a UPR consumer: left out of the CONNECT (``takeover``)."""
        self._logs: dict[int, VbLog] = {}
        """The logs this connection writes: the ones it opened with, never a log that
        replaced one since (see ``restart``)."""
        self.address = f"{config.tap_upstream[0]}:{config.tap_upstream[1]}"
        self._machine = TapConsumerMachine(f"upstream {self.address}", dialed=True)
        """What each packet from the upstream asks for (one for the Ingest's life, so an
        unknown opcode is logged once)."""
        self.connected = trio.Event()
        self.connections = 0
        self.batches = 0
        self.messages = 0
        self.last_error: str | None = None
        self._repeats = Repeats()
        """An upstream down for hours: one warning a minute, not one per retry."""
        self.fast = True
        """Item frames skip the event objects (``tap_to_log_fast``); tests turn it off."""
        self.clock: Callable[[], float] = time.time
        """Wall-clock seconds: items' arrival, and what decides an expiration."""
        self._session_scope = trio.CancelScope()
        """The current connection's (``restart`` cancels it)."""
        self._restart = ""
        self._stepped = False
        """The read being applied took more than one step (``STEP_FRAMES``): behind."""
        self._group: GroupCommit | None = None
        """The pipelined commits of the connection streaming now (fsync batch or never)."""

    async def run(self) -> None:
        """Stream from the upstream for ever, reconnecting with backoff."""
        delay = self.config.reconnect_min
        while True:
            started = self.messages
            logged = True
            try:
                with trio.CancelScope() as self._session_scope:
                    await self._session()
                    self.last_error = "upstream closed the TAP stream"
                if self._session_scope.cancelled_caught:
                    # Asked for (``restart``): not a fault, so no backoff and no warning.
                    log.info("upstream %s: TAP stream reopened: %s", self.address, self._restart)
                    self.stats.upstream_reconnects_total[self.address] += 1
                    continue
            except LogWriteError as exc:
                if self._session_scope.cancel_called:
                    # Its log was replaced under it (``restart``): the write was fenced off.
                    log.info("upstream %s: TAP stream reopened: %s", self.address, self._restart)
                    self.stats.upstream_reconnects_total[self.address] += 1
                    continue
                self.last_error = str(exc)
                logged = False
                log.error("%s; TAP stream reopened in %.2fs to write it again", exc, delay)
                self.stats.upr_log.note_write_failure(errno_name(exc), str(exc))
            except OSError as exc:  # "connection refused", not trio's "all attempts failed"
                self.last_error = describe(exc, self.config.tap_upstream[0])
            except (trio.BrokenResourceError, GatewayError, EOFError) as exc:
                self.last_error = str(exc) or type(exc).__name__
            if logged:
                level, note = self._repeats.level(self.last_error or "")
                log.log(level, "upstream %s: %s; reconnecting in %.2fs%s",
                        self.address, self.last_error, delay, note)  # fmt: skip
            self.stats.upstream_reconnects_total[self.address] += 1
            await trio.sleep(delay)
            progressed = self.messages > started and logged
            if progressed:
                self._repeats.reset()
            delay = (
                self.config.reconnect_min
                if progressed
                else min(delay * 2, self.config.reconnect_max)
            )

    def restart(self, why: str) -> None:
        """Drop the TAP connection now and open a new one at once: a log set aside while
        serving is fetched whole again (the new connection deregisters first).

        The connection may still apply what it had read before it sees the cancel; it
        applies it to the logs it opened with (``_logs``), so a log set aside is the
        one written, and it is retired: its writes raise and nothing is acked. The
        log that replaced it gets only what the new connection fetches."""
        self._restart = why
        self._session_scope.cancel()

    # -- one connection ---------------------------------------------------------

    async def session(self) -> None:
        """One connection, until the upstream closes it (a takeover's whole life)."""
        await self._session()

    async def _session(self) -> None:
        host, port = self.config.tap_upstream
        client = await PacketConnection.connect(
            host, port, name=f"tap upstream {self.address}", ssl_context=self.config.upstream_ssl
        )
        async with client:
            if self.config.upstream_user is not None:
                await client.sasl_plain(
                    self.config.upstream_user, self.config.upstream_password or ""
                )
            vbuckets = await self._vbuckets(client)
            if not self.takeover:
                listed = vbuckets
                vbuckets = tuple(vb for vb in listed if vb not in self.handed_over)
                if listed and not vbuckets:  # an empty list would ask for every vbucket
                    self.connected.set()
                    await trio.sleep_forever()
            logs = await self.logs.ensure_all(vbuckets)  # off the trio loop: many fsyncs
            self._logs = {v.vbucket: v for v in logs}
            if not self.takeover and any(_cannot_resume(v) for v in logs):
                # No cursor, no position: the node backfills what has no checkpoint.
                await client.request(
                    Opcode.DEREGISTER_TAP_CLIENT, key=self.name.encode(), check=False
                )
            await client.send(encode(self.connect_event(logs)))
            self.connections += 1
            self.connected.set()
            await self._stream(client)

    async def _vbuckets(self, client: PacketConnection) -> tuple[int, ...]:
        if self.vbuckets is not None:
            return self.vbuckets
        states = await client.stats("vbucket")
        active = sorted(
            int(k[3:]) for k, v in states.items() if k.startswith("vb_") and v == "active"
        )
        if active or states:
            return tuple(active)
        seqnos = await client.stats("vbucket-seqno")
        return tuple(
            sorted({int(k[3:].split(":")[0]) for k in seqnos if k.endswith(":high_seqno")})
        )

    def connect_event(self, logs: list[VbLog]) -> TapConnect:
        # A vbucket that cannot resume names a checkpoint no node holds: a 2.5.1 node
        # backfills a vbucket only when the checkpoint it would start at is gone
        # (tapconnection.cc ``registerCursor``), and left out it starts at
        # checkpoint 1, which a young vbucket still holds.
        checkpoints = tuple(
            (v.vbucket, NO_SUCH_CHECKPOINT if _cannot_resume(v) else last)
            for v in logs
            if (last := v.translator.last_closed_checkpoint) or _cannot_resume(v)
        )
        flags = CONNECT_FLAGS
        if self.takeover:
            # A one-off connection, not registered. It resumes after the last
            # closed checkpoint, or backfills whole when there is none, so it
            # alone carries every item up to the hand-off.
            flags = (flags | ConnectFlags.TAKEOVER_VBUCKETS) & ~ConnectFlags.REGISTERED_CLIENT
        return TapConnect(
            self.name.encode(),
            ConnectFlags(flags),
            backfill_date=0,
            vbuckets=tuple(v.vbucket for v in logs),
            checkpoints=checkpoints,
        )

    async def _stream(self, client: PacketConnection) -> None:
        if self.takeover or self.config.fsync == "always":
            await self._read(client, None)
            return
        try:
            async with trio.open_nursery() as nursery:
                group = GroupCommit(
                    self._commit_now,
                    client.stream.send_all,
                    early=self.config.fsync == "batch",
                    wrote=self._wrote,
                )
                nursery.start_soon(group.run)
                self._group = group
                try:
                    await self._read(client, group)
                    await group.flush()  # the upstream closed: what it sent is logged and acked
                finally:
                    self._group = None
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as errors:
            raise _first_error(errors) from None  # what ``run`` tells apart (a failed write)

    async def _read(self, client: PacketConnection, group: GroupCommit | None) -> None:
        reader: FrameReader = client.reader
        stream = client.stream
        if self.fast and self.recording is None:
            await self._stream_in_place(reader, stream, group)
            return
        while True:
            frames = reader.frames()
            if not frames:
                data = await stream.receive_some(RECEIVE_SIZE)
                if not data:
                    return
                reader.receive_data(data)
                if group is not None:
                    group.pending_bytes += len(data)
                continue
            if group is None:
                replies = await self._apply(frames, stream)
                if replies:
                    await stream.send_all(b"".join(replies))
                continue
            # A read of 256 KiB holds thousands of frames: applied in slices, with the
            # streams and the commit let in between, no one step stalls the loop long.
            for start in range(0, len(frames), STEP_FRAMES):
                if start:
                    await trio.lowlevel.checkpoint()
                await self._apply(frames[start : start + STEP_FRAMES], stream)
                await group.room()

    async def _stream_in_place(
        self, reader: FrameReader, stream: trio.abc.Stream, group: GroupCommit | None
    ) -> None:
        """The fast path's loop: the frames of each read are logged where they lie in
        it (``_apply_read``), and a frame cut short waits for the next read."""
        data = reader.take_buffered()
        while True:
            if frame_end(data, 0, reader.lenient_responses) is not None:
                replies, used = await self._apply_read(data, reader, stream)
                if replies:
                    await stream.send_all(b"".join(replies))
                data = data[used:]
                if group is not None:  # a read of fewer than STEP_FRAMES frames waits here
                    await group.room()
                    if group.early and not self._stepped:
                        await _let_serve()  # receive_some yields once more, data or not
                self._stepped = False
            more = await stream.receive_some(RECEIVE_SIZE)
            if not more:
                return
            if group is not None:
                group.pending_bytes += len(more)
            data = data + more if data else bytes(more)  # bytes: keys must hash

    async def _apply_read(
        self, data: bytes, reader: FrameReader, stream: trio.abc.Stream
    ) -> tuple[list[bytes], int]:
        """Log the whole frames of ``data``: the acks and NOOP replies to send once
        they are durable (none when pipelined: the group commit sends them), and the
        offset of the first frame not whole in it.

        Item and checkpoint frames go through ``log_buffer`` in place; any other
        frame is handed alone to ``reader`` (which refuses what it refuses) and
        takes the event path. Pipelined, the read is applied ``STEP_FRAMES`` items
        at a time, each step submitted to the group commit, with the streams and
        the commit let in between.
        """
        now = self.clock()
        batch = _Batch()
        always = self.config.fsync == "always"
        group = self._group
        limit = 1 if always else STEP_FRAMES if group is not None else -1
        logs = self._logs
        lenient = reader.lenient_responses
        offset = framed = 0  # framed: up to where ``reader.consumed`` counts
        try:
            while True:
                offset, taken = log_buffer(
                    data, offset, logs, now, batch.touched, batch.acks, limit
                )
                batch.messages += taken
                if taken and always:
                    await self._commit(batch.touched)
                    batch.touched = {}
                    continue
                if taken == limit and group is not None:
                    group.submit(batch.touched, batch.replies + batch.acks)
                    batch.touched, batch.replies, batch.acks = {}, [], []
                    self._stepped = True
                    await trio.lowlevel.checkpoint()
                    await group.room()
                    continue
                end = frame_end(data, offset, lenient)
                if end is None:
                    break
                reader.consumed += offset - framed  # so its errors name the stream offset
                reader.receive_data(data[offset:end])
                frame = reader.next_frame()  # raises for a frame it refuses
                offset = framed = end
                if frame is not None:
                    await self._event(frame, now, batch, stream)
        finally:
            self.messages += batch.messages  # once per batch, whatever stopped it
        reader.consumed += offset - framed
        self.batches += 1
        return await self._settle(batch), offset

    async def _apply(self, frames: list[Frame], stream: trio.abc.Stream) -> list[bytes]:
        """Log one batch of frames on the event path (``fast`` off, or a capture
        recording); the acks and NOOP replies to send once durable (none when
        pipelined: the group commit sends them)."""
        now = self.clock()
        batch = _Batch()
        try:
            for frame in frames:
                await self._event(frame, now, batch, stream)
        finally:
            self.messages += batch.messages  # once per batch, whatever stopped it
        self.batches += 1
        return await self._settle(batch)

    async def _settle(self, batch: _Batch) -> list[bytes]:
        """Pipelined, hand ``batch`` to the group commit (which acks it once durable);
        else commit it now and return what to send."""
        if self._group is not None:
            self._group.submit(batch.touched, batch.replies + batch.acks)
            return []
        await self._commit(batch.touched)
        return batch.replies + batch.acks

    async def _event(
        self, frame: Frame, now: float, batch: _Batch, stream: trio.abc.Stream
    ) -> None:
        """Log one frame through its event (counted in ``batch.messages`` unless a NOOP)."""
        decision = self._machine.receive_frame(frame)
        event = decision.event
        if self.recording is not None and event is not None:
            self.recording.record(event, now)
        do = decision.do
        if do is Do.APPLY:
            batch.messages += 1
            await self._apply_message(decision.message, now, batch, stream)
        elif do is Do.SKIP:  # an OPAQUE of unknown size: acked, not logged
            batch.messages += 1
        elif do is Do.CLOSE:
            await self._close(decision, batch, stream)
        elif event is None:  # an unknown request, answered UNKNOWN_COMMAND
            self.stats.protocol_errors_total["upr_front", "upstream_unknown_opcode"] += 1
        if decision.note is not None:
            log.log(logging.getLevelName(decision.note.level.upper()), decision.note.text)
        if decision.reply:  # sent once what came before is durable
            (batch.acks if do is Do.APPLY or do is Do.SKIP else batch.replies).append(
                decision.reply
            )

    async def _apply_message(
        self, event: TapStreamMessage, now: float, batch: _Batch, stream: trio.abc.Stream
    ) -> None:
        """Write one stream message to its log (a FLUSH to every log)."""
        always = self.config.fsync == "always"
        logs = self._logs
        kind = type(event)
        if kind is TapMutation or kind is TapDelete:  # the common case first
            vbucket = event.vbucket
            vblog = logs.get(vbucket) or await self._open(vbucket)
            vblog.ingest(event, now)
            batch.touched[vbucket] = vblog
            if always:
                await self._commit(batch.touched)
                batch.touched = {}
            return
        if isinstance(event, TapVbucketSet) and self.state_hook is not None:
            # Durable first: what came before the state change is logged.
            await self._commit(batch.touched)
            batch.touched = {}
            if batch.replies or batch.acks:
                await stream.send_all(b"".join(batch.replies + batch.acks))
                batch.replies, batch.acks = [], []
            await self.state_hook(event.vbucket, event.state)
        if isinstance(event, TapFlush):
            # A flush of the whole bucket, sent on vbucket 0 (2.5.1 ep_engine.cc
            # ``tapNotify`` flushes every vbucket): every log this connection writes.
            for vbucket, vblog in logs.items():
                vblog.ingest(TapFlush(vbucket, event.opaque, event.tap_flags, event.ttl), now)
                batch.touched[vbucket] = vblog
            if always:
                await self._commit(batch.touched)
                batch.touched = {}
        elif not (isinstance(event, TapOpaque) and event.vbucket not in logs):
            vblog = logs.get(event.vbucket) or await self._open(event.vbucket)
            vblog.ingest(event, now)
            batch.touched[event.vbucket] = vblog
            if always:
                await self._commit(batch.touched)
                batch.touched = {}

    async def _close(self, decision: Decision, batch: _Batch, stream: trio.abc.Stream) -> NoReturn:
        """Close on the machine's word: a 2.x producer closes on the nack of an expired
        TTL (memcached 2.x answers it EINVAL), so once what came before is logged and
        acked (the nack acks it implicitly there), answer so and close. A CONNECT, a
        TAP request that does not decode or a response it cannot take closes at once,
        unanswered, with nothing more acked: the producer sends it all again."""
        assert decision.error is not None
        if decision.reply:
            await self._commit(batch.touched)
            batch.touched = {}
            await stream.send_all(b"".join([*batch.replies, *batch.acks, decision.reply]))
            batch.replies, batch.acks = [], []
        raise decision.error

    async def _open(self, vbucket: int) -> VbLog:
        """The log of a vbucket the node sends and the CONNECT did not name."""
        vblog = (await self.logs.ensure_all((vbucket,)))[0]
        return self._logs.setdefault(vbucket, vblog)

    async def _commit(self, touched: dict[int, VbLog]) -> None:
        """Commit ``touched`` and, when pipelined, everything submitted before."""
        if self._group is not None:
            await self._group.flush(touched)
        else:
            await self._commit_now(touched)

    def _wrote(self, written: int) -> None:
        self.stats.upr_log.bytes_on_disk += written

    async def _commit_now(self, touched: dict[int, VbLog]) -> None:
        if touched:
            try:
                written = await commit(
                    touched,
                    sync=self.config.fsync != "never",
                    # A takeover publishes only what is synced: it hands the vbucket over.
                    early=self.config.fsync == "batch" and not self.takeover,
                )
            except LogWriteError:
                self.logs.refresh_stats()
                raise
            self.stats.upr_log.bytes_on_disk += written
