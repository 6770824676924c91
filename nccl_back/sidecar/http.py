"""The health port's HTTP/1.x: one request parsed under hard limits, and the reply bytes.

Limits below; no chunked bodies, no line folding, a deciding header (``Content-Length``,
``Host``, the drain token) given once only, and no keep-alive (``Connection: close``:
bytes after the first request are never read as a second one).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from nccl_back.errors import NcclBackError

#: Bytes of request line plus headers at most (nginx's default buffer is 8 KiB too).
MAX_HEAD_BYTES = 8192
#: Header lines at most.
MAX_HEADERS = 64
#: Bytes of request body at most (no endpoint reads one; a client may still send one).
MAX_BODY_BYTES = 4096
#: Request-target length at most.
MAX_TARGET = 2048
#: Header carrying the drain token.
TOKEN_HEADER = "X-Drain-Token"
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(r"/[\x21-\x7e]*")
_VERSION = re.compile(r"HTTP/1\.[01]")
# Control characters other than tab are never part of a header value (RFC 9110 5.5).
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_REASONS = {
    200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 413: "Content Too Large",
    414: "URI Too Long", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    503: "Service Unavailable",
}


class BadRequest(NcclBackError):
    """An HTTP request to the health port is malformed or over one of its limits;
    ``status`` is the 4xx answered (the connection is then closed)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Request:
    """One parsed HTTP/1.x request: header names lower-cased, the body as sent."""

    method: str
    target: str
    version: str
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


def parse_request(data: bytes) -> Request | None:
    """The request at the start of ``data``, ``None`` while it is incomplete, or
    :class:`BadRequest` (with its 4xx) when it is malformed or over a limit. Bytes
    after the request are ignored: there is no keep-alive, hence no pipelining."""
    end = data.find(b"\r\n\r\n")
    if (len(data) if end < 0 else end + 4) > MAX_HEAD_BYTES:
        raise BadRequest(431, f"request head over {MAX_HEAD_BYTES} bytes")
    if end < 0:
        return None
    # latin-1 maps every byte, so decoding never fails; the rules below refuse the rest.
    lines = data[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise BadRequest(400, "request line must be METHOD SP TARGET SP HTTP/1.x")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise BadRequest(400, "bad method")
    if len(target) > MAX_TARGET:
        raise BadRequest(414, f"request target over {MAX_TARGET} characters")
    if not _TARGET.fullmatch(target):
        raise BadRequest(400, "request target must be a path (origin form)")
    if not _VERSION.fullmatch(version):
        raise BadRequest(400, "only HTTP/1.0 and HTTP/1.1 are spoken here")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, f"over {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            # A leading space is an obsolete line folding: refused (RFC 9112 5.2).
            raise BadRequest(400, "malformed header line")
        value = value.strip(" \t")
        if _BAD_VALUE.search(value):
            raise BadRequest(400, "control character in a header value")
        key = name.lower()
        if key in headers:
            if key in ("content-length", "host", TOKEN_HEADER.lower()):
                raise BadRequest(400, f"header {name} given twice")
            headers[key] = f"{headers[key]}, {value}"
        else:
            headers[key] = value
    if "transfer-encoding" in headers:
        raise BadRequest(400, "Transfer-Encoding is not accepted; send Content-Length")
    length_text = headers.get("content-length", "0")
    if not length_text.isascii() or not length_text.isdigit() or len(length_text) > 12:
        raise BadRequest(400, "Content-Length must be a decimal number")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise BadRequest(413, f"body over {MAX_BODY_BYTES} bytes")
    body = data[end + 4 : end + 4 + length]
    if len(body) < length:
        return None
    return Request(method, target, version, headers, bytes(body))


def response(code: int, body: bytes, content_type: str, send_body: bool) -> bytes:
    """A whole reply (head, and the body unless ``send_body`` is false, as for HEAD)."""
    head = (
        f"HTTP/1.1 {code} {_REASONS.get(code, 'Unknown')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "Cache-Control: no-store\r\n\r\n"
    ).encode("ascii")
    return head + body if send_body else head


#: Content type of every plain-text reply.
TEXT = "text/plain; charset=utf-8"
