"""TLS with the standard library's ``ssl`` through ``trio.SSLStream``.

Couchbase 3.0 served memcached over TLS on its own port (11207). Here a
listener serves TLS when given a certificate and key (``--tls-cert``,
``--tls-key``), and the gateway's upstream connections use TLS with
``--upstream-tls`` (the node's certificate checked against the system's CAs,
or against ``--upstream-ca FILE``, and its host name against the upstream
address). Errors name the option, the path and the reason in one line.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import trio

from gateway.cli.startup import StartupError


def server_context(cert: Path, key: Path | None) -> ssl.SSLContext:
    """A server context from a PEM certificate chain and its key (the key may be in
    the certificate file)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        if path is not None and not path.is_file():
            raise StartupError(f"{option} {path}: no such file")
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise StartupError(
            f"--tls-cert {cert} / --tls-key {key or cert}: not a usable certificate and key "
            f"({exc.reason or exc})"
        ) from None
    except OSError as exc:
        raise StartupError(f"--tls-cert {cert}: cannot read it: {exc.strerror}") from None
    return context


def client_context(ca: Path | None = None, *, option: str = "--upstream-ca") -> ssl.SSLContext:
    """Checks the server's certificate: against ``ca`` when given, else the system's CAs.
    ``option`` names the command line option that gave ``ca``, for the error line."""
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    except FileNotFoundError:
        raise StartupError(f"{option} {ca}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise StartupError(f"{option} {ca}: not a usable CA file ({exc})") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def open_stream(
    host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> trio.abc.Stream:
    """A TCP connection to ``host:port``, with TLS (handshake done) when ``ssl_context``."""
    stream = await trio.open_tcp_stream(host, port)
    if ssl_context is None:
        return stream
    secured = trio.SSLStream(stream, ssl_context, server_hostname=host)
    try:
        await secured.do_handshake()
    except trio.BrokenResourceError as exc:
        await stream.aclose()
        cause = exc.__cause__
        reason = getattr(cause, "verify_message", None) or getattr(cause, "reason", None)
        raise OSError(f"TLS handshake with {host}:{port} failed: {reason or cause}") from None
    return secured
