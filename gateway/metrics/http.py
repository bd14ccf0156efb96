"""Just enough HTTP/1.1 for a metrics endpoint: request heads in, responses out.

Sans-IO: ``find_head_end`` and ``parse_request_head`` work on bytes the
server has read; ``response`` builds the bytes to write. The server accepts
GET and HEAD without a body, one request at a time per connection
(keep-alive, no pipelining of bodies since none are accepted). Anything it
cannot serve correctly is refused with a specific status and reason:

- 400: malformed request line, header line, or Content-Length; a missing
  Host header on HTTP/1.1; a request target that is not a path;
- 413: a request with a body; 431: a head over the size limit;
- 501: Transfer-Encoding (no request bodies are taken at all);
- 505: an HTTP version other than 1.0 or 1.1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from email.utils import formatdate
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 8192
MAX_HEADERS = 100

_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_DIGITS = re.compile(r"^[0-9]{1,18}$")
_VERSION = re.compile(rb"^HTTP/(\d)\.(\d)$")

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class HttpError(Exception):
    """A request the server refuses: answer ``status`` with ``detail`` and close."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status} {REASONS[status]}: {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    version: tuple[int, int]
    headers: dict[str, str]
    """Lower-case names; repeated headers joined with ", " as RFC 9110 allows."""

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version >= (1, 1):
            return "close" not in tokens
        return "keep-alive" in tokens

    def header(self, name: str) -> str:
        return self.headers.get(name, "")


def find_head_end(buffer: bytes | bytearray) -> int:
    """Length of the request head in ``buffer`` (through the blank line), or -1."""
    end = buffer.find(b"\r\n\r\n")
    if end >= 0:
        return end + 4
    end = buffer.find(b"\n\n")  # bare LF line ends, which RFC 9112 lets servers accept
    return end + 2 if end >= 0 else -1


def parse_request_head(head: bytes) -> Request:
    lines = head.replace(b"\r\n", b"\n").split(b"\n")
    while lines and not lines[-1]:
        lines.pop()
    # RFC 9112 2.2: ignore at least one empty line before the request line.
    while lines and not lines[0]:
        lines.pop(0)
    if not lines:
        raise HttpError(400, "empty request")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not all(parts):
        raise HttpError(400, f"malformed request line {lines[0][:100]!r}")
    method, target, version_text = parts
    if not _TOKEN.match(method):
        raise HttpError(400, f"malformed method {method[:40]!r}")
    version_match = _VERSION.match(version_text)
    if version_match is None:
        raise HttpError(400, f"malformed HTTP version {version_text[:40]!r}")
    version = (int(version_match[1]), int(version_match[2]))
    if version not in ((1, 0), (1, 1)):
        raise HttpError(505, f"HTTP/{version[0]}.{version[1]} is not served")
    headers = _parse_headers(lines[1:])
    if version == (1, 1) and "host" not in headers:
        raise HttpError(400, "HTTP/1.1 request without a Host header")
    if "transfer-encoding" in headers:
        raise HttpError(501, "request bodies (Transfer-Encoding) are not accepted")
    length = headers.get("content-length")
    if length is not None:
        values = {v.strip() for v in length.split(",")}
        if len(values) != 1 or not _DIGITS.match(next(iter(values))):
            raise HttpError(400, f"malformed Content-Length {length[:40]!r}")
        if int(next(iter(values))):
            raise HttpError(413, "request bodies are not accepted")
    return Request(method.decode("ascii"), _path(target), version, headers)


def _parse_headers(lines: list[bytes]) -> dict[str, str]:
    if len(lines) > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete line folding in headers")
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):
            raise HttpError(400, f"malformed header line {line[:60]!r}")
        try:
            text = value.strip(b" \t").decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes any byte
            raise HttpError(400, "undecodable header value") from None
        if any(c in text for c in "\r\n\0"):
            raise HttpError(400, f"control character in header {name.decode()!r}")
        key = name.decode("ascii").lower()
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


def _path(target: bytes) -> str:
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        raise HttpError(400, "request target is not ASCII") from None
    if text.startswith("/"):
        return text.split("?", 1)[0]
    if text.startswith(("http://", "https://")):  # absolute form, as proxies send it
        return urlsplit(text).path or "/"
    raise HttpError(400, f"request target {text[:60]!r} is not a path")


def accepts_gzip(accept_encoding: str) -> bool:
    for item in accept_encoding.split(","):
        coding, *params = (p.strip() for p in item.split(";"))
        if coding.lower() == "gzip":
            for param in params:
                name, _, value = param.partition("=")
                if name.strip().lower() == "q":
                    try:
                        return float(value) > 0
                    except ValueError:
                        return False
            return True
    return False


def response(
    status: int,
    body: bytes,
    *,
    content_type: str = "text/plain; charset=utf-8",
    headers: tuple[tuple[str, str], ...] = (),
    head_only: bool = False,
    close: bool = False,
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {REASONS[status]}",
        f"Date: {formatdate(usegmt=True)}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers),
    ]
    if close:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


def error_response(error: HttpError, *, head_only: bool = False) -> bytes:
    extra = (("Allow", "GET, HEAD"),) if error.status == 405 else ()
    body = f"{error.status} {REASONS[error.status]}: {error.detail}\n".encode()
    return response(error.status, body, headers=extra, head_only=head_only, close=True)
