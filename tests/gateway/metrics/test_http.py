"""The sans-IO HTTP request-head parser of the metrics server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.metrics.http import (
    MAX_HEADERS,
    HttpError,
    accepts_gzip,
    error_response,
    find_head_end,
    parse_request_head,
    response,
)


def test_plain_get() -> None:
    head = b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept: text/plain\r\nX-A: 1\r\nx-a: 2\r\n\r\n"
    assert find_head_end(head + b"extra") == len(head)
    req = parse_request_head(head)
    assert (req.method, req.path, req.version) == ("GET", "/metrics", (1, 1))
    assert req.header("accept") == "text/plain"
    assert req.header("x-a") == "1, 2"
    assert req.keep_alive


def test_keep_alive_rules() -> None:
    assert not parse_request_head(
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    ).keep_alive
    assert not parse_request_head(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert parse_request_head(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive


def test_bare_line_feeds_and_absolute_form() -> None:
    head = b"GET http://127.0.0.1:9/metrics HTTP/1.1\nHost: x\n\n"
    assert find_head_end(head) == len(head)
    assert parse_request_head(head).path == "/metrics"
    assert find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n") == -1


@pytest.mark.parametrize(
    ("head", "status", "words"),
    [
        (b"\r\n\r\n", 400, "empty request"),
        (b"GET /metrics\r\n\r\n", 400, "malformed request line"),
        (b"GET  /metrics HTTP/1.1\r\n\r\n", 400, "malformed request line"),
        (b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "malformed method"),
        (b"GET / HTTX/1.1\r\n\r\n", 400, "malformed HTTP version"),
        (b"GET / HTTP/2.0\r\n\r\n", 505, "HTTP/2.0"),
        (b"GET / HTTP/1.1\r\n\r\n", 400, "without a Host"),
        (b"GET / HTTP/1.1\r\nHost a\r\n\r\n", 400, "malformed header line"),
        (b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400, "line folding"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n", 413, "bodies"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n", 400, "Content-Length"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1, 2\r\n\r\n", 400, "Content-Length"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: \xb2\r\n\r\n", 400, "Content-Length"),
        (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", 501, "Transfer"),
        (b"GET metrics HTTP/1.1\r\nHost: a\r\n\r\n", 400, "not a path"),
        (b"GET /\xff HTTP/1.1\r\nHost: a\r\n\r\n", 400, "not ASCII"),
    ],
)
def test_refusals_say_what_was_wrong(head: bytes, status: int, words: str) -> None:
    with pytest.raises(HttpError) as caught:
        parse_request_head(head)
    assert caught.value.status == status
    assert words in str(caught.value)


def test_zero_content_length_is_fine() -> None:
    req = parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
    assert req.path == "/"


def test_too_many_headers() -> None:
    lines = b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    with pytest.raises(HttpError) as caught:
        parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\n" + lines + b"\r\n")
    assert caught.value.status == 431


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("gzip", True),
        ("deflate, gzip;q=0.5", True),
        ("GZIP", True),
        ("gzip;q=0", False),
        ("gzip;q=zero", False),
        ("identity", False),
        ("", False),
    ],
)
def test_accepts_gzip(header: str, expected: bool) -> None:
    assert accepts_gzip(header) is expected


def test_responses() -> None:
    reply = response(200, b"abc", content_type="text/x", headers=(("Vary", "Accept"),))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: 3" in head and b"Vary: Accept" in head
    assert body == b"abc"
    assert b"Connection" not in head
    refused = error_response(HttpError(405, "method POST on /metrics"), head_only=True)
    assert refused.endswith(b"\r\n\r\n")
    assert b"Allow: GET, HEAD" in refused and b"Connection: close" in refused


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_parse_or_raise_http_error(data: bytes) -> None:
    end = find_head_end(data)
    assert end == -1 or 0 < end <= len(data)
    try:
        req = parse_request_head(data[:end] if end > 0 else data)
    except HttpError as error:
        assert 400 <= error.status < 600
    else:
        assert req.path.startswith("/")


token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    method=st.sampled_from(["GET", "HEAD", "POST", "DELETE"]),
    path=st.from_regex(r"\A/[a-z0-9/_.-]{0,30}\Z"),
    headers=st.dictionaries(token, st.text(alphabet="abc xyz;=/,", max_size=20), max_size=8),
)
def test_valid_heads_round_trip(method: str, path: str, headers: dict[str, str]) -> None:
    headers = {k: v for k, v in headers.items() if k not in ("content-length", "transfer-encoding")}
    headers["host"] = "gw"
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    req = parse_request_head(("\r\n".join(lines) + "\r\n\r\n").encode())
    assert (req.method, req.path) == (method, path)
    assert req.headers == {k: v.strip(" \t") for k, v in headers.items()}
