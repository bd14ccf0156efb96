"""Who may connect: the users file, password hashes, SASL checks, admin rights.

The users file holds one user a line; blank lines and ``#`` comments are
ignored::

    replica:plain text password
    backup:pbkdf2_sha256$200000$<salt, base64>$<hash, base64>
    admin ops:another password

The secret is the password itself or a salted PBKDF2-SHA256 hash made by
``tap-upr-gateway hash-password``. A line that starts with the word
``admin`` marks that user an admin. As soon as one user is marked admin,
destructive commands (DEREGISTER_TAP_CLIENT, TAP takeover, UPR takeover
streams, SET_VBUCKET) are refused to every other user; a file that marks
no one admin lets every user run them, as before.

``Authenticator`` checks one connection's SASL attempts: passwords and
digests are compared in constant time, a failure is logged (user and peer,
never the secret) and counted, each further failure waits longer before its
answer, and the connection is closed after ``max_failures``.

Mechanisms are those memcached 2.5/3.0 offered through cbsasl, in its order:
``CRAM-MD5 PLAIN`` (couchbase/cbsasl 266cfd1 src/cbsasl.c
``cbsasl_list_mechs``), since couchbase-cli's ``cb_bin_client`` tries
CRAM-MD5 first. CRAM-MD5 (couchbase/kv_engine e21fb47
cbsasl/cram-md5/cram-md5.c): SASL_AUTH ``CRAM-MD5`` with an empty value is
answered AUTH_CONTINUE carrying a fresh challenge (16 lowercase hex digits
of 8 random bytes); the next SASL_STEP carries ``user`` + one byte +
the 32 hex digits of HMAC-MD5(password, challenge), the user being all
but its last 33 bytes. A challenge serves one STEP. A STEP of 33 bytes or
fewer, like an unknown mechanism, is refused INVALID_ARGUMENTS
(``SASL_BADPARAM``, daemon/memcached.c ``process_bin_complete_sasl_auth``);
a wrong digest, an unknown user or a STEP with no challenge pending gets
AUTH_ERROR. Every refusal counts as a failure.

CRAM-MD5 needs the plain-text password: a user whose secret is a PBKDF2
hash cannot pass it and fails exactly as a wrong password does (the client
sees the same answer; the log says why). Hashed users log in with PLAIN,
which cb_bin_client falls back to.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Status
from gateway.io.limits import ListenerCounters

log = logging.getLogger("gateway.io.auth")

HASH_SCHEME = "pbkdf2_sha256"
DEFAULT_ITERATIONS = 200_000
SALT_BYTES = 16
ADMIN_MARK = "admin "
DEFAULT_MAX_FAILURES = 5
DEFAULT_FAILURE_DELAY = 0.25
"""Seconds before the answer to the first failure; doubled for each further one."""
MAX_FAILURE_DELAY = 4.0
PLAIN = b"PLAIN"
CRAM_MD5 = b"CRAM-MD5"
MECHANISMS = b"CRAM-MD5 PLAIN"
"""The SASL_LIST_MECHS answer: cbsasl's list, CRAM-MD5 first."""
NONCE_BYTES = 8
CRAM_DIGEST_HEX = 32


class TooManyFailures(ProtocolError):
    """A connection failed SASL too often; raising it closes the connection."""


class UsersFileError(Exception):
    """The users file cannot be used; the message names the file (and line)."""


def hash_password(
    password: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
) -> str:
    """``pbkdf2_sha256$<iterations>$<salt>$<hash>`` (base64) for the users file."""
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return "$".join(
        (
            HASH_SCHEME,
            str(iterations),
            base64.b64encode(salt).decode(),
            base64.b64encode(digest).decode(),
        )
    )


def _parse_hash(secret: str) -> tuple[int, bytes, bytes] | None:
    """(iterations, salt, digest) of a hashed secret; None for a plain-text password."""
    parts = secret.split("$")
    if len(parts) != 4 or parts[0] != HASH_SCHEME:
        return None
    try:
        iterations = int(parts[1])
        salt = base64.b64decode(parts[2], validate=True)
        digest = base64.b64decode(parts[3], validate=True)
    except ValueError:
        return None
    if iterations < 1 or not digest:
        return None
    return iterations, salt, digest


@dataclass(frozen=True)
class User:
    name: str
    secret: str
    admin: bool = False

    def matches(self, password: str) -> bool:
        """Constant time in the password (for a given secret)."""
        hashed = _parse_hash(self.secret)
        if hashed is None:
            return hmac.compare_digest(password.encode(), self.secret.encode())
        iterations, salt, digest = hashed
        candidate = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
        return hmac.compare_digest(candidate, digest)

    @property
    def hashed(self) -> bool:
        return _parse_hash(self.secret) is not None


_NOBODY = User("", "\x00 no such user \x00")


class Users:
    """The users a listener accepts (see the module docstring)."""

    def __init__(self, users: Mapping[str, User]) -> None:
        self.users = dict(users)
        self.admins_marked = any(u.admin for u in self.users.values())

    @classmethod
    def of(cls, value: Users | Mapping[str, str] | None) -> Users | None:
        """``Users`` from a plain ``{user: password}`` mapping (kept for callers and tests)."""
        if value is None or isinstance(value, Users):
            return value
        return cls({name: User(name, secret) for name, secret in value.items()})

    def __len__(self) -> int:
        return len(self.users)

    def verify(self, name: str, password: str) -> User | None:
        # An unknown user costs the same comparison, so timing does not tell who exists.
        user = self.users.get(name)
        ok = (user or _NOBODY).matches(password)
        return user if ok and user is not None else None

    def verify_cram(self, name: str, challenge: bytes, digest: bytes) -> User | None:
        """The user whose plain-text password keys HMAC-MD5(challenge) to ``digest``
        (lowercase hex); a hashed or unknown user costs the same and fails."""
        user = self.users.get(name)
        usable = user is not None and not user.hashed
        key = (user if usable and user is not None else _NOBODY).secret.encode()
        expected = hmac.new(key, challenge, "md5").hexdigest().encode()
        ok = hmac.compare_digest(expected, digest)
        return user if ok and usable else None

    def may_administer(self, name: str | None) -> bool:
        """Whether ``name`` may run destructive commands (see the module docstring)."""
        if not self.admins_marked:
            return True
        user = self.users.get(name or "")
        return user is not None and user.admin

    @property
    def slow(self) -> bool:
        """Some secret is a hash: checks belong in a worker thread."""
        return any(u.hashed for u in self.users.values())


def read_users(path: str | Path) -> Users:
    """Read a users file; an unreadable, malformed or empty one raises ``UsersFileError``."""
    users: dict[str, User] = {}
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise UsersFileError(f"--users {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsersFileError(f"--users {path}: not UTF-8 text") from None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        admin = line.startswith(ADMIN_MARK)
        if admin:
            line = line[len(ADMIN_MARK) :].lstrip()
        name, sep, secret = line.partition(":")
        if not sep or not name:
            raise UsersFileError(
                f"--users {path}:{number}: expected user:password (or admin user:password)"
            )
        if secret.startswith(HASH_SCHEME + "$") and _parse_hash(secret) is None:
            raise UsersFileError(
                f"--users {path}:{number}: user {name!r}: malformed {HASH_SCHEME} hash "
                "(make one with `tap-upr-gateway hash-password`)"
            )
        users[name] = User(name, secret, admin)
    if not users:
        raise UsersFileError(
            f"--users {path}: no users in it; every client would be refused "
            "(add user:password lines, or leave out --users to require no authentication)"
        )
    return users_file_checked(Users(users), path)


def users_file_checked(users: Users, path: str | Path) -> Users:
    mode = _mode(path)
    if mode is not None and mode & 0o077 and any(not u.hashed for u in users.users.values()):
        log.warning(
            "--users %s holds plain-text passwords and is readable by other users (mode %o); "
            "chmod 600 it or store hashes (tap-upr-gateway hash-password)",
            path,
            mode,
        )
    return users


def _mode(path: str | Path) -> int | None:
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        return None


def plain_credentials(frame: Frame) -> tuple[str, str] | None:
    """(user, password) of a SASL PLAIN AUTH frame; None when it is not one."""
    fields = frame.value.split(b"\x00")
    if frame.key != b"PLAIN" or len(fields) != 3:
        return None
    return fields[1].decode("utf-8", "replace"), fields[2].decode("utf-8", "replace")


def cram_response(value: bytes) -> tuple[str, bytes] | None:
    """(user, hex digest) of a CRAM-MD5 STEP value; None when it is too short.
    As cbsasl, the byte before the digest is not looked at."""
    if len(value) <= CRAM_DIGEST_HEX + 1:
        return None
    user = value[: -(CRAM_DIGEST_HEX + 1)]
    return user.decode("utf-8", "replace"), value[-CRAM_DIGEST_HEX:]


class CramMd5:
    """One connection's CRAM-MD5 exchange (sans IO): an AUTH starts it and
    replaces any pending challenge, the next STEP takes the challenge."""

    def __init__(self) -> None:
        self.challenge: bytes | None = None

    def start(self) -> bytes:
        self.challenge = secrets.token_hex(NONCE_BYTES).encode()
        return self.challenge

    def take(self) -> bytes | None:
        challenge, self.challenge = self.challenge, None
        return challenge

    @property
    def pending(self) -> bool:
        return self.challenge is not None


@dataclass(frozen=True)
class AuthOutcome:
    user: str | None
    """The authenticated user (None: refused or continuing)."""
    message: str
    """What to answer a refusal with."""
    closing: ProtocolError | None = None
    """Too many failures: answer, then raise this (it closes the connection)."""
    status: int = Status.AUTH_ERROR
    """The refusal's status."""
    challenge: bytes | None = None
    """CRAM-MD5 started: answer AUTH_CONTINUE with this."""


class Authenticator:
    """SASL PLAIN and CRAM-MD5 for one connection (see the module docstring)."""

    def __init__(
        self,
        users: Users | None,
        *,
        label: str,
        peer: str,
        counters: ListenerCounters | None = None,
        max_failures: int = DEFAULT_MAX_FAILURES,
        failure_delay: float = DEFAULT_FAILURE_DELAY,
    ) -> None:
        self.users = users
        self.label = label
        self.peer = peer
        self.counters = counters
        self.max_failures = max_failures
        self.failure_delay = failure_delay
        self.failures = 0
        self.user: str | None = None
        self.cram = CramMd5()

    def may_administer(self) -> bool:
        return self.users is None or self.users.may_administer(self.user)

    async def authenticate(self, frame: Frame) -> AuthOutcome:
        """Check a SASL_AUTH frame; waits before answering a failure; after too many,
        the outcome carries the ``ProtocolError`` to raise once the answer is queued."""
        self.cram.take()  # a new AUTH abandons an exchange (cbsasl_server_start)
        if frame.key == CRAM_MD5:
            if frame.value:
                # cbsasl would step at once, against a challenge the client never saw
                return await self._failed(frame, None, "CRAM-MD5 takes no initial response")
            return AuthOutcome(None, "", challenge=self.cram.start())
        if frame.key != PLAIN:
            return await self._failed(
                frame,
                None,
                f"unknown SASL mechanism; offered: {MECHANISMS.decode()}",
                Status.INVALID_ARGUMENTS,
            )
        credentials = plain_credentials(frame)
        if credentials is None:
            return await self._failed(frame, None, "malformed SASL PLAIN token")
        name, password = credentials
        if self.users is None:
            self.user = name
            return AuthOutcome(name, "")
        users = self.users
        if users.slow:
            user = await trio.to_thread.run_sync(users.verify, name, password)
        else:
            user = users.verify(name, password)
        if user is None:
            return await self._failed(frame, name, "authentication failed")
        self.user = name
        return AuthOutcome(name, "")

    @property
    def expecting_step(self) -> bool:
        """A CRAM-MD5 challenge waits for its SASL_STEP."""
        return self.cram.pending

    async def step(self, frame: Frame) -> AuthOutcome:
        """Check a SASL_STEP frame (the CRAM-MD5 response), as ``authenticate``."""
        challenge = self.cram.take()
        if challenge is None:
            return await self._failed(frame, None, "SASL_STEP without a CRAM-MD5 SASL_AUTH")
        response = cram_response(frame.value)
        if response is None:
            return await self._failed(
                frame, None, "malformed CRAM-MD5 response", Status.INVALID_ARGUMENTS
            )
        name, digest = response
        if self.users is None:
            self.user = name
            return AuthOutcome(name, "")
        if self.users.verify_cram(name, challenge, digest) is None:
            known = self.users.users.get(name)
            why = (
                "CRAM-MD5 needs the plain-text password and this user's is hashed: use PLAIN"
                if known is not None and known.hashed
                else None
            )
            return await self._failed(frame, name, "authentication failed", why=why)
        self.user = name
        return AuthOutcome(name, "")

    async def _failed(
        self,
        frame: Frame,
        name: str | None,
        message: str,
        status: int = Status.AUTH_ERROR,
        *,
        why: str | None = None,
    ) -> AuthOutcome:
        self.failures += 1
        if self.counters is not None:
            self.counters.auth_failures_total[self.label] += 1
        log.warning(
            "%s: SASL authentication failed for user %r from %s (%s; failure %d of %d)",
            self.label,
            name,
            self.peer,
            why or message,
            self.failures,
            self.max_failures,
        )
        if self.failures >= self.max_failures:
            closing = TooManyFailures(
                f"{self.failures} failed SASL attempts: closing",
                opcode=frame.opcode,
                field="user",
                value=name,
            )
            return AuthOutcome(None, f"{message}; too many failures, closing", closing, status)
        await trio.sleep(min(self.failure_delay * 2 ** (self.failures - 1), MAX_FAILURE_DELAY))
        return AuthOutcome(None, message, status=status)

    def refuse_admin(self, what: str) -> str:
        """Count and log a destructive command refused; the message to answer with."""
        if self.counters is not None:
            self.counters.admin_refusals_total[self.label] += 1
        log.warning(
            "%s: %s refused to user %r from %s: not an admin in the users file",
            self.label,
            what,
            self.user,
            self.peer,
        )
        return f"{what} needs a user marked admin in the users file"
