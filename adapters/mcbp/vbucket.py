"""Which vbucket a key lives in: the CRC32 hash every Couchbase client uses."""

from __future__ import annotations

import zlib


def vbucket_of(key: bytes, vbuckets: int) -> int:
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % vbuckets
