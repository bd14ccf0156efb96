"""SASL CRAM-MD5 as memcached 2.5/3.0 offered it, on every listener.

Pinned to:
- couchbase/cbsasl 266cfd1 src/cbsasl.c: ``cbsasl_list_mechs`` answers
  ``CRAM-MD5 PLAIN``; ``cbsasl_server_start`` refuses an unknown mechanism
  with SASL_BADPARAM and, for a known one, drops any exchange in progress.
- couchbase/kv_engine e21fb47 cbsasl/cram-md5/cram-md5.c: the challenge is
  8 random bytes in lowercase hex; the STEP is ``user`` + one byte + 32 hex
  digits of HMAC-MD5 keyed with the password, the user all but the last 33
  bytes; 33 bytes or fewer is SASL_BADPARAM, a wrong digest or unknown user
  SASL_FAIL.
- daemon/memcached.c ``process_bin_complete_sasl_auth`` (abhinavdangeti/memcached
  6208adb, the cbsasl daemon): SASL_CONTINUE is AUTH_CONTINUE (0x21) with the
  challenge as value, SASL_OK ``Authenticated``, SASL_BADPARAM EINVAL (0x04),
  anything else AUTH_ERROR (0x20). A STEP with no AUTH before it would
  reach cbsasl with no connection there; memcached's own daemon
  (``sasl_started``) answers it AUTH_ERROR, as here.
- couchbase/couchbase-cli 6106f70 cb_bin_client.py ``sasl_auth_cram_md5``,
  emulated byte for byte below (cbbackup/cbtransfer try it before PLAIN).
"""

from __future__ import annotations

import hmac
import logging
import random
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.mcbp import Opcode, Status
from adapters.mcbp.frames import Frame
from gateway.io.auth import MECHANISMS, Authenticator, User, Users, hash_password
from gateway.io.limits import ListenerCounters
from tests.gateway.listeners import KINDS, start_listener

FAST_HASH = 1000

# couchbaseConstants.py
REQ_PKT_FMT = RES_PKT_FMT = struct.Struct(">BBHBBHIIQ")
MIN_RECV_PACKET = REQ_PKT_FMT.size
CMD_STAT, CMD_SASL_LIST_MECHS, CMD_SASL_AUTH, CMD_SASL_STEP = 0x10, 0x20, 0x21, 0x22
CMD_DEREGISTER_TAP_CLIENT = 0x9E
ERR_AUTH_ERROR, ERR_AUTH_CONTINUE, ERR_EINVAL = 0x20, 0x21, 0x04


class MemcachedError(Exception):
    def __init__(self, status: int, msg: bytes) -> None:
        super().__init__(f"Memcached error #{status}: {msg!r}")
        self.status = status
        self.msg = msg


class CbBinClient:
    """cb_bin_client ``MemcachedClient``: one request, one reply, raised on error."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.s = stream
        self.r = random.Random()
        self.buffered = b""

    @classmethod
    async def connect(cls, port: int) -> CbBinClient:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def _recv(self, n: int) -> bytes:
        while len(self.buffered) < n:
            data = await self.s.receive_some(65536)
            if not data:
                raise EOFError("Got empty data (remote died?).")
            self.buffered += data
        out, self.buffered = self.buffered[:n], self.buffered[n:]
        return out

    async def _doCmd(self, cmd: int, key: bytes, val: bytes) -> tuple[int, bytes]:
        opaque = self.r.randint(0, 2**32 - 1)
        msg = REQ_PKT_FMT.pack(0x80, cmd, len(key), 0, 0, 0, len(key) + len(val), opaque, 0)
        await self.s.send_all(msg + key + val)
        header = await self._recv(MIN_RECV_PACKET)
        magic, _cmd, _kl, _el, _dt, errcode, remaining, got, _cas = RES_PKT_FMT.unpack(header)
        rv = await self._recv(remaining)
        assert magic in (0x81, 0x80), f"Got magic: {magic}"
        assert got == opaque, f"expected opaque {opaque:x}, got {got:x}"
        if errcode != 0:
            raise MemcachedError(errcode, rv)
        return got, rv

    async def sasl_mechanisms(self) -> set[bytes]:
        return set((await self._doCmd(CMD_SASL_LIST_MECHS, b"", b""))[1].split(b" "))

    async def sasl_auth_plain(self, user: bytes, password: bytes) -> tuple[int, bytes]:
        return await self._doCmd(CMD_SASL_AUTH, b"PLAIN", b"\0".join([b"", user, password]))

    async def sasl_auth_cram_md5(self, user: bytes, password: bytes) -> tuple[int, bytes]:
        challenge = b""
        try:
            await self._doCmd(CMD_SASL_AUTH, b"CRAM-MD5", b"")
        except MemcachedError as e:
            if e.status != ERR_AUTH_CONTINUE:
                raise
            challenge = e.msg
        dig = hmac.new(password, challenge, "md5").hexdigest().encode()
        return await self._doCmd(CMD_SASL_STEP, b"CRAM-MD5", user + b" " + dig)

    async def login(self, user: bytes, password: bytes) -> str:
        """pump_upr / pump_tap: CRAM-MD5 first, PLAIN when it raises; which one worked."""
        try:
            await self.sasl_auth_cram_md5(user, password)
            return "CRAM-MD5"
        except MemcachedError:
            await self.sasl_auth_plain(user, password)
            return "PLAIN"

    async def stats(self) -> None:
        await self._doCmd(CMD_STAT, b"", b"")  # the first line is enough: not refused


def users() -> Users:
    return Users(
        {
            "backup": User("backup", "s3cret"),
            "hashed": User("hashed", hash_password("h4sh", iterations=FAST_HASH)),
            "ops": User("ops", "root", admin=True),
        }
    )


def auth_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "gateway.io.auth" and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("kind", KINDS)
async def test_cb_bin_client_logs_in_with_cram_md5_at_the_first_try(
    nursery: trio.Nursery, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    listener = await start_listener(nursery, kind, tmp_path, users=users())
    with trio.fail_after(20):
        client = await CbBinClient.connect(listener.port)
        with pytest.raises(MemcachedError) as refused:
            await client.stats()
        assert refused.value.status == ERR_AUTH_ERROR
        assert await client.sasl_mechanisms() == {b"CRAM-MD5", b"PLAIN"}
        assert await client.login(b"backup", b"s3cret") == "CRAM-MD5"
        await client.stats()
        await client.s.aclose()
    assert listener.counters.auth_failures_total[kind] == 0
    assert auth_warnings(caplog) == []


@pytest.mark.parametrize("kind", KINDS)
async def test_a_wrong_cram_password_is_refused_logged_and_counted(
    nursery: trio.Nursery, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    listener = await start_listener(nursery, kind, tmp_path, users=users())
    with trio.fail_after(20):
        client = await CbBinClient.connect(listener.port)
        with pytest.raises(MemcachedError) as refused:
            await client.sasl_auth_cram_md5(b"backup", b"guess-w0rd")
        assert refused.value.status == ERR_AUTH_ERROR
        assert refused.value.msg == b"authentication failed"
        with pytest.raises(MemcachedError) as still:
            await client.stats()
        assert still.value.status == ERR_AUTH_ERROR
        await client.s.aclose()
    assert listener.counters.auth_failures_total[kind] == 1
    (warning,) = auth_warnings(caplog)
    assert "user 'backup' from 127.0.0.1:" in warning
    assert "guess-w0rd" not in caplog.text and "s3cret" not in caplog.text


async def test_a_hashed_user_fails_cram_like_a_wrong_password_then_plain_works(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    listener = await start_listener(nursery, "node", tmp_path, users=users())
    with trio.fail_after(20):
        client = await CbBinClient.connect(listener.port)
        with pytest.raises(MemcachedError) as refused:
            await client.sasl_auth_cram_md5(b"hashed", b"h4sh")
        assert (refused.value.status, refused.value.msg) == (
            ERR_AUTH_ERROR,
            b"authentication failed",
        )
        assert await client.login(b"hashed", b"h4sh") == "PLAIN"
        await client.stats()
        await client.s.aclose()
    assert listener.counters.auth_failures_total["node"] == 2
    assert "this user's is hashed: use PLAIN" in caplog.text
    assert "h4sh" not in caplog.text


@pytest.mark.parametrize("kind", KINDS)
async def test_stray_steps_and_unknown_mechanisms_get_memcached_statuses(
    nursery: trio.Nursery, tmp_path: Path, kind: str
) -> None:
    listener = await start_listener(nursery, kind, tmp_path, users=users())
    with trio.fail_after(20):
        client = await CbBinClient.connect(listener.port)
        with pytest.raises(MemcachedError) as stray:
            await client._doCmd(CMD_SASL_STEP, b"CRAM-MD5", b"backup " + b"0" * 32)
        assert stray.value.status == ERR_AUTH_ERROR
        with pytest.raises(MemcachedError) as unknown:
            await client._doCmd(CMD_SASL_AUTH, b"DIGEST-MD5", b"")
        assert unknown.value.status == ERR_EINVAL
        with pytest.raises(MemcachedError) as started:
            await client._doCmd(CMD_SASL_AUTH, b"CRAM-MD5", b"")
        challenge = started.value.msg
        assert len(challenge) == 16 and challenge == challenge.lower()
        int(challenge, 16)
        with pytest.raises(MemcachedError) as short:
            await client._doCmd(CMD_SASL_STEP, b"CRAM-MD5", b"x" + b"0" * 32)
        assert short.value.status == ERR_EINVAL
        # that STEP used the challenge up: the right digest now comes too late
        dig = hmac.new(b"s3cret", challenge, "md5").hexdigest().encode()
        with pytest.raises(MemcachedError) as late:
            await client._doCmd(CMD_SASL_STEP, b"CRAM-MD5", b"backup " + dig)
        assert late.value.status == ERR_AUTH_ERROR
        assert await client.login(b"backup", b"s3cret") == "CRAM-MD5"
        await client.s.aclose()


async def test_admin_marking_holds_for_cram_logins(nursery: trio.Nursery, tmp_path: Path) -> None:
    listener = await start_listener(nursery, "tap-front", tmp_path, users=users())
    with trio.fail_after(20):
        app = await CbBinClient.connect(listener.port)
        assert await app.login(b"backup", b"s3cret") == "CRAM-MD5"
        with pytest.raises(MemcachedError) as refused:
            await app._doCmd(CMD_DEREGISTER_TAP_CLIENT, b"someone", b"")
        assert refused.value.status == ERR_AUTH_ERROR
        ops = await CbBinClient.connect(listener.port)
        assert await ops.login(b"ops", b"root") == "CRAM-MD5"
        await ops._doCmd(CMD_DEREGISTER_TAP_CLIENT, b"someone", b"")
        await app.s.aclose()
        await ops.s.aclose()
    assert listener.counters.admin_refusals_total["tap-front"] == 1


# The Authenticator alone, any sequence of SASL requests (virtual time: the
# failure delays cost nothing).


def request(opcode: int, key: bytes, value: bytes) -> Frame:
    return Frame(0x80, opcode, len(key), 0, 0, 0, 1, 0, key + value)


@dataclass
class Model:
    pending: bool = False
    failures: int = 0
    user: str | None = None


ACTIONS = (
    "cram",
    "cram-with-value",
    "step-good",
    "step-wrong",
    "step-short",
    "step-hashed",
    "plain-good",
    "plain-bad",
    "unknown",
    "mechs",
)
MAX_FAILURES = 6


async def act(auth: Authenticator, action: str) -> tuple[int | None, str | None]:
    """Run one request; (status or None when authenticated/continuing, user)."""
    pending = auth.cram.challenge or b"no challenge"
    step = Opcode.SASL_STEP
    frames = {
        "cram": request(Opcode.SASL_AUTH, b"CRAM-MD5", b""),
        "cram-with-value": request(Opcode.SASL_AUTH, b"CRAM-MD5", b"backup " + b"0" * 32),
        "step-good": request(
            step, b"CRAM-MD5", b"backup " + hmac.new(b"s3cret", pending, "md5").hexdigest().encode()
        ),
        "step-wrong": request(step, b"CRAM-MD5", b"backup " + b"0" * 32),
        "step-short": request(step, b"CRAM-MD5", b"b" + b"0" * 32),
        "step-hashed": request(
            step, b"CRAM-MD5", b"hashed " + hmac.new(b"h4sh", pending, "md5").hexdigest().encode()
        ),
        "plain-good": request(Opcode.SASL_AUTH, b"PLAIN", b"\0backup\0s3cret"),
        "plain-bad": request(Opcode.SASL_AUTH, b"PLAIN", b"\0backup\0nope"),
        "unknown": request(Opcode.SASL_AUTH, b"SCRAM-SHA1", b""),
    }
    if action == "mechs":
        return None, auth.user
    frame = frames[action]
    outcome = await (auth.step(frame) if frame.opcode == step else auth.authenticate(frame))
    if outcome.challenge is not None:
        assert outcome.user is None and len(outcome.challenge) == 16
        return None, None
    if outcome.user is not None:
        return None, outcome.user
    return outcome.status, None


def expected(model: Model, action: str) -> int | None:
    """Advance the model; the refusal status it predicts (None: no refusal)."""
    pending, model.pending = model.pending, action == "cram"
    if action == "mechs":
        model.pending = pending
        return None
    status: int | None
    if action == "cram":
        status = None
    elif action == "unknown" or (action == "step-short" and pending):
        status = Status.INVALID_ARGUMENTS
    elif (action == "step-good" and pending) or action == "plain-good":
        status = None
        model.user = "backup"
    else:
        status = Status.AUTH_ERROR
    if status is not None:
        model.failures += 1
    return status


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(ACTIONS), max_size=12))
def test_any_sequence_of_sasl_requests_follows_the_model(actions: list[str]) -> None:
    counters = ListenerCounters()

    async def run() -> None:
        auth = Authenticator(
            users(), label="t", peer="p", counters=counters, max_failures=MAX_FAILURES
        )
        model = Model()
        challenges: set[bytes] = set()
        for action in actions:
            if model.failures >= MAX_FAILURES:
                break  # the connection is closed
            status, user = await act(auth, action)
            assert status == expected(model, action), action
            assert auth.expecting_step == model.pending
            if model.pending and action == "cram":
                assert auth.cram.challenge not in challenges  # fresh each time
                challenges.add(auth.cram.challenge or b"")
            assert auth.failures == model.failures
            assert auth.user == model.user
            if status is None and user is not None:
                assert user == "backup"
        assert counters.auth_failures_total["t"] == model.failures

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_mechanism_list_is_cbsasls() -> None:
    assert MECHANISMS == b"CRAM-MD5 PLAIN"
