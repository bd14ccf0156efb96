"""The packet diagrams of the protocol documents, as golden vectors.

``tests/data/seed-packets.json`` is a copy of the project's shared vector
set: each entry has the source document and line, the dialect, the packet
as hex, and the breakdown the document prints for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "seed-packets.json"


@dataclass(frozen=True)
class Vector:
    source: str
    dialect: str
    line: int
    packet: bytes
    framing_consistent: bool
    breakdown: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


@cache
def all_vectors() -> tuple[Vector, ...]:
    raw = json.loads(DATA.read_text())
    return tuple(
        Vector(
            entry["source"],
            entry["dialect"],
            entry["line"],
            bytes.fromhex(entry["hex"]),
            entry["framing_consistent"],
            tuple(entry["breakdown"]),
        )
        for entry in raw
    )


def vectors(dialect: str) -> dict[int, Vector]:
    """The vectors of one dialect, by the line of their document."""
    return {v.line: v for v in all_vectors() if v.dialect == dialect}


def patch(packet: bytes, offset: int, new: bytes) -> bytes:
    """``packet`` with the bytes at ``offset`` replaced by ``new``."""
    return packet[:offset] + new + packet[offset + len(new) :]
