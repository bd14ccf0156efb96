"""The users file (plain text, PBKDF2 hashes, admins), SASL failures on every listener,
and destructive commands kept for admins.

memcached 3.0 (daemon/memcached.c, ``process_bin_complete_sasl_auth``) answers
a failed SASL AUTH with AUTH_ERROR and keeps the connection; here the answer
is the same, but each further failure waits longer and the connection is
closed after a handful.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import Opcode, Status
from adapters.mcbp.frames import Frame, FrameReader
from adapters.tap import ConnectFlags, encode
from gateway.io.auth import (
    HASH_SCHEME,
    Authenticator,
    User,
    Users,
    UsersFileError,
    hash_password,
    read_users,
)
from gateway.io.connection import PacketConnection, RequestFailed
from gateway.io.limits import ConnectionLimits, ListenerCounters
from tests.gateway.listeners import KINDS, read_until_closed, sasl, start_listener
from tests.support.tap_client import connect_event

FAST_HASH = 1000  # iterations: enough to exercise the scheme, quick in tests


def sasl_frame(user: str, password: str) -> Frame:
    token = b"\x00" + user.encode() + b"\x00" + password.encode()
    return Frame(0x80, Opcode.SASL_AUTH, 5, 0, 0, 0, 1, 0, b"PLAIN" + token)


@settings(max_examples=25, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40), st.binary(min_size=1, max_size=32))
def test_a_hash_matches_its_password_only(password: str, other: str, salt: bytes) -> None:
    secret = hash_password(password, iterations=FAST_HASH, salt=salt)
    assert secret.startswith(HASH_SCHEME + "$1000$")
    user = User("u", secret)
    assert user.hashed
    assert user.matches(password)
    assert user.matches(other) == (other == password)


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40))
def test_plain_text_secrets_compare_exactly(secret: str, password: str) -> None:
    assert User("u", secret).matches(password) == (secret == password)


def test_the_users_file_reads_plain_hashed_and_admin_users(tmp_path: Path) -> None:
    hashed = hash_password("h4shed", iterations=FAST_HASH)
    path = tmp_path / "users"
    path.write_text(f"# comment\n\nreplica:plain:with:colons\nbackup:{hashed}\nadmin ops:root pw\n")
    users = read_users(path)
    assert len(users) == 3
    assert users.verify("replica", "plain:with:colons") is not None
    assert users.verify("backup", "h4shed") is not None
    assert users.verify("backup", hashed) is None  # the hash is not the password
    assert users.verify("ops", "root pw") is not None
    assert users.verify("nobody", "") is None
    assert users.may_administer("ops")
    assert not users.may_administer("replica")
    assert not users.may_administer(None)
    assert Users.of({"a": "b"}).may_administer("a")  # no admin marked: everyone may


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "no users in it"),
        ("# only a comment\n\n", "no users in it"),
        ("nocolon\n", ":1: expected user:password"),
        ("x:pbkdf2_sha256$zz$$\n", ":1: user 'x': malformed pbkdf2_sha256 hash"),
    ],
)
def test_an_unusable_users_file_is_refused_naming_it(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "users"
    path.write_text(content)
    with pytest.raises(UsersFileError) as caught:
        read_users(path)
    assert str(caught.value).startswith(f"--users {path}")
    assert expected in str(caught.value)


def test_failures_wait_longer_each_time_then_close() -> None:
    """Virtual time (a mock clock): the delays double, the fifth failure closes."""
    counters = ListenerCounters()
    waits: list[float] = []

    async def attempts() -> None:
        auth = Authenticator(Users.of({"alice": "wonder"}), label="t", peer="p", counters=counters)
        for _ in range(4):
            before = trio.current_time()
            outcome = await auth.authenticate(sasl_frame("alice", "nope"))
            waits.append(trio.current_time() - before)
            assert outcome.user is None and outcome.closing is None
        last = await auth.authenticate(sasl_frame("alice", "nope"))
        assert last.closing is not None
        assert (await auth.authenticate(sasl_frame("alice", "wonder"))).user == "alice"

    trio.run(attempts, clock=trio.testing.MockClock(autojump_threshold=0))
    assert waits == [0.25, 0.5, 1.0, 2.0]
    assert counters.auth_failures_total["t"] == 5


@pytest.mark.parametrize("kind", KINDS)
async def test_failed_logins_are_logged_counted_and_end_the_connection(
    nursery: trio.Nursery, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    limits = ConnectionLimits(auth_failure_delay=0.01, max_auth_failures=3)
    users = Users({"alice": User("alice", hash_password("wonder", iterations=FAST_HASH))})
    listener = await start_listener(nursery, kind, tmp_path, users=users, limits=limits)
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        for attempt in range(3):
            await stream.send_all(sasl("alice", "s3cret-guess", opaque=attempt))
        received = await read_until_closed(stream)
        await stream.aclose()
        replies = _frames(received)
        assert [f.vbucket_or_status for f in replies] == [Status.AUTH_ERROR] * 3
        assert replies[-1].value == b"authentication failed; too many failures, closing"
        async with await PacketConnection.connect("127.0.0.1", listener.port) as good:
            await good.sasl_plain("alice", "wonder")
    assert listener.counters.auth_failures_total[kind] == 3
    assert "SASL authentication failed for user 'alice' from 127.0.0.1:" in caplog.text
    assert "failure 3 of 3" in caplog.text
    assert "3 failed SASL attempts: closing" in caplog.text
    assert "s3cret-guess" not in caplog.text


def _frames(data: bytes) -> list[Frame]:
    reader = FrameReader()
    reader.receive_data(data)
    return reader.frames()


def admin_users() -> Users:
    return Users({"ops": User("ops", "root", admin=True), "app": User("app", "pw")})


async def test_tap_front_keeps_deregister_and_takeover_for_admins(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    listener = await start_listener(nursery, "tap-front", tmp_path, users=admin_users())
    takeover = encode(
        connect_event(
            b"mover",
            ConnectFlags.TAKEOVER_VBUCKETS | ConnectFlags.LIST_VBUCKETS,
            vbuckets=(1,),
        )
    )
    with trio.fail_after(20):
        async with await PacketConnection.connect("127.0.0.1", listener.port) as app:
            await app.sasl_plain("app", "pw")
            with pytest.raises(RequestFailed) as refused:
                await app.request(Opcode.DEREGISTER_TAP_CLIENT, key=b"someone")
            assert refused.value.status == Status.AUTH_ERROR
            assert b"needs a user marked admin" in refused.value.text
            await app.send(takeover)
            reply = await app.next_frame()
            assert reply.vbucket_or_status == Status.AUTH_ERROR
        async with await PacketConnection.connect("127.0.0.1", listener.port) as ops:
            await ops.sasl_plain("ops", "root")
            await ops.request(Opcode.DEREGISTER_TAP_CLIENT, key=b"someone")
    assert listener.counters.admin_refusals_total["tap-front"] == 2


async def test_node_keeps_set_vbucket_deregister_and_takeover_for_admins(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    listener = await start_listener(nursery, "node", tmp_path, users=admin_users())
    replica = struct.pack(">I", 2)
    with trio.fail_after(20):
        async with await PacketConnection.connect("127.0.0.1", listener.port) as app:
            await app.sasl_plain("app", "pw")
            for opcode, extras in (
                (Opcode.SET_VBUCKET, replica),
                (Opcode.DEREGISTER_TAP_CLIENT, b""),
            ):
                with pytest.raises(RequestFailed) as refused:
                    await app.request(opcode, key=b"" if extras else b"x", extras=extras, vbucket=1)
                assert refused.value.status == Status.NO_ACCESS
            await app.request(Opcode.SET, key=b"k", value=b"v", extras=bytes(8))  # not destructive
        async with await PacketConnection.connect("127.0.0.1", listener.port) as ops:
            await ops.sasl_plain("ops", "root")
            await ops.request(Opcode.SET_VBUCKET, extras=replica, vbucket=1)
    assert listener.counters.admin_refusals_total["node"] == 2


@pytest.mark.parametrize("kind", ["node", "upr-front"])
async def test_upr_takeover_streams_are_kept_for_admins(
    nursery: trio.Nursery, tmp_path: Path, kind: str
) -> None:
    from tests.support.upr_client import UprClient

    listener = await start_listener(nursery, kind, tmp_path, users=admin_users())
    with trio.fail_after(20):
        login = await PacketConnection.connect("127.0.0.1", listener.port)
        await login.sasl_plain("app", "pw")
        client = UprClient(login.stream, upr.DCP)
        try:
            reply = await client.open(b"mover", upr.OpenFlags.PRODUCER)
            assert reply.status == Status.SUCCESS
            answer = await client.stream_request(1, flags=upr.StreamFlags.TAKEOVER)
            assert answer.status == Status.NO_ACCESS
        finally:
            await client.aclose()
    assert listener.counters.admin_refusals_total[kind] == 1


user_names = st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), blacklist_characters=":#"),
    min_size=1,
    max_size=12,
).filter(lambda name: name != "admin" and name.strip() == name)
secrets = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), max_size=20).filter(
    lambda secret: secret.strip() == secret
)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(user_names, st.tuples(secrets, st.booleans()), min_size=1, max_size=5))
def test_a_users_file_reads_back_what_was_written(
    tmp_path_factory: pytest.TempPathFactory, entries: dict[str, tuple[str, bool]]
) -> None:
    path = tmp_path_factory.mktemp("users") / "users"
    path.write_text(
        "".join(
            ("admin " if admin else "") + f"{name}:{secret}\n"
            for name, (secret, admin) in entries.items()
        )
    )
    users = read_users(path)
    assert len(users) == len(entries)
    for name, (secret, admin) in entries.items():
        assert users.verify(name, secret) is not None
        assert users.verify(name, secret + "x") is None
        assert users.users[name].admin == admin
