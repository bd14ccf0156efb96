"""``tap-upr-gateway load``: drive writes, deletes and short TTLs at a node.

Keys are ``load::<n>``; each goes to its vbucket by the CRC32 hash, so the
target must own every vbucket it is sent (the reference node does). A
fraction of writes carry a short TTL so that expirations happen, and a
fraction of keys written earlier are deleted. Requests are pipelined in
batches; ``--rate`` caps operations per second. Prints ops/s at the end.
"""

from __future__ import annotations

import random
import ssl
import struct
import time
from dataclasses import dataclass, field

import trio

from adapters.mcbp import Magic, Opcode, Status, encode_frame
from adapters.mcbp.vbucket import vbucket_of
from gateway.io.connection import PacketConnection

_SET_EXTRAS = struct.Struct(">II")
BATCH = 256


@dataclass
class LoadReport:
    sets: int = 0
    deletes: int = 0
    with_ttl: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ops(self) -> int:
        return self.sets + self.deletes

    def summary(self) -> str:
        rate = self.ops / self.seconds if self.seconds else 0.0
        errors = ", ".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"{self.ops} ops in {self.seconds:.2f}s = {rate:,.0f} ops/s "
            f"(sets {self.sets}, of which {self.with_ttl} with TTL; deletes {self.deletes}; "
            f"errors: {errors})"
        )


async def vbucket_count(client: PacketConnection) -> int:
    stats = await client.stats("vbucket-seqno")
    count = sum(1 for key in stats if key.endswith(":high_seqno"))
    if not count:
        raise RuntimeError("target reported no vbuckets in STAT vbucket-seqno")
    return count


async def run_load(
    host: str,
    port: int,
    *,
    items: int,
    value_size: int = 100,
    ttl_fraction: float = 0.0,
    ttl_seconds: int = 2,
    delete_fraction: float = 0.0,
    rate: float | None = None,
    seed: int = 0,
    key_prefix: str = "load",
    user: str | None = None,
    password: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> LoadReport:
    """Write ``items`` keys (then delete a fraction of them) and report."""
    rng = random.Random(seed)
    report = LoadReport()
    async with await PacketConnection.connect(
        host, port, name="load", ssl_context=ssl_context
    ) as client:
        if user is not None:
            await client.sasl_plain(user, password or "")
        vbuckets = await vbucket_count(client)
        value = bytes(rng.getrandbits(8) for _ in range(value_size))
        started = time.monotonic()
        plan: list[tuple[int, bytes, int]] = []  # (opcode, key, expiration)
        for n in range(items):
            ttl = ttl_seconds if rng.random() < ttl_fraction else 0
            plan.append((Opcode.SET, f"{key_prefix}::{n}".encode(), ttl))
        deletes = [k for _, k, ttl in plan if ttl == 0 and rng.random() < delete_fraction]
        plan.extend((Opcode.DELETE, key, 0) for key in deletes)
        for start in range(0, len(plan), BATCH):
            batch = plan[start : start + BATCH]
            packets = []
            for index, (opcode, key, ttl) in enumerate(batch):
                vb = vbucket_of(key, vbuckets)
                if opcode == Opcode.SET:
                    packets.append(
                        encode_frame(
                            Magic.REQUEST,
                            Opcode.SET,
                            vbucket_or_status=vb,
                            opaque=index,
                            extras=_SET_EXTRAS.pack(0, int(time.time()) + ttl if ttl else 0),
                            key=key,
                            value=value,
                        )
                    )
                else:
                    packets.append(
                        encode_frame(
                            Magic.REQUEST,
                            Opcode.DELETE,
                            vbucket_or_status=vb,
                            opaque=index,
                            key=key,
                        )
                    )
            await client.send(b"".join(packets))
            for _ in batch:
                frame = await client.next_frame()
                opcode, _, ttl = batch[frame.opaque]
                if frame.vbucket_or_status != Status.SUCCESS:
                    name = _status(frame.vbucket_or_status)
                    report.errors[name] = report.errors.get(name, 0) + 1
                elif opcode == Opcode.SET:
                    report.sets += 1
                    report.with_ttl += bool(ttl)
                else:
                    report.deletes += 1
            if rate:
                ahead = (start + len(batch)) / rate - (time.monotonic() - started)
                if ahead > 0:
                    await trio.sleep(ahead)
        report.seconds = time.monotonic() - started
    return report


def _status(code: int) -> str:
    try:
        return Status(code).name.lower()
    except ValueError:
        return f"0x{code:02x}"
