"""A plain memcached-binary client over trio: requests, STAT and SASL PLAIN.

Used to query upstream nodes (``STAT vbucket-seqno``), to authenticate before
a TAP or UPR stream starts, by the load generator and by tests. Requests are
answered in order; ``request`` waits for the response with its opaque.
"""

from __future__ import annotations

import itertools
import ssl
from types import TracebackType

import trio

from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import Frame, FrameReader, Magic, Opcode, Status, encode_frame
from adapters.mcbp.constants import status_name

RECEIVE_SIZE = 256 * 1024


class RequestFailed(GatewayError):
    """The server answered a request with an error status."""

    def __init__(self, opcode: int, status: int, text: bytes) -> None:
        self.opcode = opcode
        self.status = status
        self.text = text
        detail = text.decode("utf-8", "replace")
        super().__init__(
            f"opcode 0x{opcode:02x} failed: {status_name(status)} (0x{status:02x})"
            + (f": {detail}" if detail else "")
        )


class McbpClient:
    def __init__(self, stream: trio.abc.Stream, *, name: str = "client") -> None:
        self.stream = stream
        self.name = name
        self.reader = FrameReader()
        self._opaques = itertools.count(1)

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        name: str = "client",
        ssl_context: ssl.SSLContext | None = None,
    ) -> McbpClient:
        """Connect over TCP, or TLS when ``ssl_context`` is given."""
        from gateway.tls import open_stream

        return cls(await open_stream(host, port, ssl_context), name=name)

    async def __aenter__(self) -> McbpClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    async def send(self, packet: bytes) -> None:
        await self.stream.send_all(packet)

    async def receive_frame(self) -> Frame:
        while True:
            frame = self.reader.next_frame()
            if frame is not None:
                return frame
            data = await self.stream.receive_some(RECEIVE_SIZE)
            if not data:
                raise ProtocolError(f"{self.name}: server closed the connection")
            self.reader.receive_data(data)

    def next_opaque(self) -> int:
        return next(self._opaques) & 0xFFFFFFFF

    async def request(
        self,
        opcode: int,
        *,
        key: bytes = b"",
        value: bytes = b"",
        extras: bytes = b"",
        vbucket: int = 0,
        cas: int = 0,
        check: bool = True,
    ) -> Frame:
        """Send one request and return its response (raise on error status if ``check``)."""
        opaque = self.next_opaque()
        await self.send(
            encode_frame(
                Magic.REQUEST,
                opcode,
                vbucket_or_status=vbucket,
                opaque=opaque,
                cas=cas,
                extras=extras,
                key=key,
                value=value,
            )
        )
        while True:
            frame = await self.receive_frame()
            if frame.magic == Magic.RESPONSE and frame.opaque == opaque:
                break
        if check and frame.vbucket_or_status != Status.SUCCESS:
            raise RequestFailed(opcode, frame.vbucket_or_status, frame.value)
        return frame

    async def stats(self, group: str = "") -> dict[str, str]:
        """``STAT group``: the key/value responses up to the empty one."""
        opaque = self.next_opaque()
        await self.send(encode_frame(Magic.REQUEST, Opcode.STAT, opaque=opaque, key=group.encode()))
        out: dict[str, str] = {}
        while True:
            frame = await self.receive_frame()
            if frame.opaque != opaque or frame.magic != Magic.RESPONSE:
                continue
            if frame.vbucket_or_status != Status.SUCCESS:
                raise RequestFailed(Opcode.STAT, frame.vbucket_or_status, frame.value)
            if not frame.key:
                return out
            out[frame.key.decode("utf-8", "replace")] = frame.value.decode("utf-8", "replace")

    async def sasl_plain(self, user: str, password: str) -> None:
        """Authenticate with SASL PLAIN (authzid empty)."""
        token = b"\x00" + user.encode() + b"\x00" + password.encode()
        await self.request(Opcode.SASL_AUTH, key=b"PLAIN", value=token)


class DestinationRefused(GatewayError):
    """A vbucket move's destination cannot take the vbucket."""


async def prepare_move_destination(client: McbpClient, vbuckets: list[int]) -> None:
    """Make each vbucket a replica on a move's destination, as the orchestrator does before
    it streams into it; an ACTIVE one is refused, never demoted (it holds live data)."""
    import struct

    from adapters.mcbp.constants import VBucketState

    states = await client.stats("vbucket")
    for vb in vbuckets:
        state = states.get(f"vb_{vb}")
        if state is None:
            raise DestinationRefused(f"vbucket {vb} does not exist on the destination")
        if state == "active":
            raise DestinationRefused(
                f"vbucket {vb} is active on the destination; refusing to overwrite it"
            )
        await client.request(
            Opcode.SET_VBUCKET, vbucket=vb, extras=struct.pack(">I", VBucketState.REPLICA)
        )
