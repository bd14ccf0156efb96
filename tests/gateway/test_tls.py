"""TLS on the listeners (``--tls-cert/--tls-key``) and to the upstream (``--upstream-tls``),
with a certificate made in the test by the ``openssl`` command.

Couchbase 3.0 served memcached over TLS on its own port (11207): the same
memcached binary protocol inside the TLS stream, nothing else changed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from adapters.mcbp import Opcode
from adapters.tap import ConnectFlags, TapMutation, encode
from gateway.cli.startup import StartupError
from gateway.io.connection import PacketConnection
from gateway.io.tls import client_context, server_context
from tests.gateway.listeners import KINDS, read_until_closed, start_listener
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import connect_event, start_node
from tests.support.tapfront import filled_store, start_front

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def make_certificate(directory: Path, name: str = "127.0.0.1") -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=IP:{name}"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("kind", KINDS)
async def test_each_listener_serves_tls_and_cuts_off_plain_peers(
    nursery: trio.Nursery,
    tmp_path: Path,
    kind: str,
    certificate: tuple[Path, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    cert, key = certificate
    listener = await start_listener(
        nursery, kind, tmp_path, users={"a": "b"}, ssl_context=server_context(cert, key)
    )
    with trio.fail_after(20):
        async with await PacketConnection.connect(
            "127.0.0.1", listener.port, ssl_context=client_context(cert)
        ) as client:
            await client.sasl_plain("a", "b")
            assert (await client.request(Opcode.VERSION)).value
        plain = await trio.open_tcp_stream("127.0.0.1", listener.port)
        await plain.send_all(b"\x80" + bytes(23))  # a memcached header, not a TLS hello
        assert await read_until_closed(plain) == b""
        await plain.aclose()
    assert "TLS handshake failed" in caplog.text


async def test_tap_front_reads_its_upstream_over_tls(
    nursery: trio.Nursery, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    store = filled_store()
    rig = await tap_front_over_node(
        nursery,
        store,
        node={"ssl_context": server_context(cert, key)},
        upstream_ssl=client_context(cert),
    )
    with trio.fail_after(20):
        client = await rig.client(
            b"tls", ConnectFlags.DUMP | ConnectFlags.BACKFILL, backfill_date=0
        )
        events = await client.collect()
    got = sum(isinstance(e, TapMutation) for e in events)
    assert got == sum(not it.deleted for vb in range(4) for it in store.items_since(vb, 0))


async def test_an_upstream_with_a_certificate_we_do_not_trust_is_refused(
    nursery: trio.Nursery, tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    other_cert, _ = make_certificate(tmp_path)  # a different CA
    _, node_port = await start_node(nursery, ssl_context=server_context(cert, key))
    with (
        trio.fail_after(20),
        pytest.raises(OSError, match=r"TLS handshake with 127\.0\.0\.1:\d+ failed"),
    ):
        await PacketConnection.connect(
            "127.0.0.1", node_port, ssl_context=client_context(other_cert)
        )
    _, port = await start_front(
        nursery, node_port, upstream_ssl=client_context(other_cert), reconnect_attempts=0
    )
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(encode(connect_event(b"x", ConnectFlags.DUMP)))
        reply = await read_until_closed(stream)
        assert b"TLS handshake with 127.0.0.1" in reply
        assert b"self-signed certificate" in reply
        await stream.aclose()


def test_unusable_certificate_files_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(StartupError, match=f"--tls-cert {missing}: no such file"):
        server_context(missing, None)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(StartupError, match=f"--tls-cert {garbage} / --tls-key {garbage}: not a"):
        server_context(garbage, None)
    with pytest.raises(StartupError, match=f"--upstream-ca {missing}: no such file"):
        client_context(missing)
