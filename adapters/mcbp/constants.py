"""Magic bytes, plain memcached opcodes and status codes."""

from __future__ import annotations

from enum import IntEnum

HEADER_SIZE = 24


class Magic(IntEnum):
    REQUEST = 0x80
    RESPONSE = 0x81


class Status(IntEnum):
    SUCCESS = 0x00
    KEY_NOT_FOUND = 0x01
    KEY_EXISTS = 0x02
    VALUE_TOO_LARGE = 0x03
    INVALID_ARGUMENTS = 0x04
    ITEM_NOT_STORED = 0x05
    NON_NUMERIC = 0x06
    NOT_MY_VBUCKET = 0x07
    AUTH_ERROR = 0x20
    AUTH_CONTINUE = 0x21
    RANGE_ERROR = 0x22
    ROLLBACK = 0x23
    NO_ACCESS = 0x24
    UNKNOWN_COMMAND = 0x81
    NO_MEMORY = 0x82
    NOT_SUPPORTED = 0x83
    INTERNAL_ERROR = 0x84
    BUSY = 0x85
    TEMPORARY_FAILURE = 0x86


class Opcode(IntEnum):
    """Plain memcached commands the gateway and the reference node speak."""

    GET = 0x00
    SET = 0x01
    ADD = 0x02
    REPLACE = 0x03
    DELETE = 0x04
    QUIT = 0x07
    NOOP = 0x0A
    VERSION = 0x0B
    STAT = 0x10
    TOUCH = 0x1C
    SASL_LIST_MECHS = 0x20
    SASL_AUTH = 0x21
    SASL_STEP = 0x22
    SET_VBUCKET = 0x3D
    GET_VBUCKET = 0x3E
    DEREGISTER_TAP_CLIENT = 0x9E
    CHANGE_VBUCKET_FILTER = 0xB0


def status_name(code: int) -> str:
    """Lower-case name of a status code, or its hex form when unknown."""
    try:
        return Status(code).name.lower()
    except ValueError:
        return f"0x{code:04x}"


class VBucketState(IntEnum):
    """Vbucket states in the engine's order (what TAP and released DCP send)."""

    ACTIVE = 1
    REPLICA = 2
    PENDING = 3
    DEAD = 4
