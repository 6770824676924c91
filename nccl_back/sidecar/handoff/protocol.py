"""The hand-off's wire protocol: one JSON line each way over a Unix socket, never pickle.

::

    consumer -> {"protocol": 2, "version", "manifest_digest", "mode"}
    server   -> {"ok": false, "reason": "version" | "manifest" | ..., "message", ...}
              | {"ok": true, "kind": "shm" | "cuda_ipc", ..., "layout", "hashes"}

Both halves use this module's framing (a line within an absolute deadline and a byte
limit), limits and refusal shape, so the two ends cannot drift apart.
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any, Literal

from nccl_back import _clock

AttachMode = Literal["copy", "zero_copy"]
MODES: tuple[AttachMode, ...] = ("copy", "zero_copy")

# 2: arena offsets are skeleton.ALIGN (64) multiples, the consolidated layout.
PROTOCOL = 2
#: Largest request line a server reads (a request is four short fields).
MAX_REQUEST = 1 << 20
#: Largest reply line a consumer reads (a refusal carries the server's whole manifest).
MAX_REPLY = 256 << 20
#: Largest arena a reply may name (1 PiB): a bound on outside data, not a model limit.
MAX_ARENA = 1 << 50


def refusal(reason: str, message: str, **extra: Any) -> dict[str, Any]:
    """A server's "no" (``reason`` is what the consumer branches on)."""
    return {"ok": False, "protocol": PROTOCOL, "reason": reason, "message": message, **extra}


def send_line(conn: socket.socket, obj: Any, deadline: float) -> None:
    """``obj`` as one compact JSON line, sent before ``deadline`` (``_clock.monotonic``)."""
    conn.settimeout(remaining(deadline))
    conn.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")


def recv_line(conn: socket.socket, deadline: float, limit: int) -> bytes:
    """One line (without its newline), of at most ``limit`` bytes (else ``ValueError``),
    before ``deadline``: the whole line's, so a dripping peer cannot hold the other side."""
    buf = bytearray()
    while True:
        conn.settimeout(remaining(deadline))
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("connection closed before a complete line")
        end = chunk.find(b"\n")
        if end >= 0:
            return bytes(buf + chunk[:end])
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"line longer than {limit} bytes")


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline``; :class:`TimeoutError` once it has passed."""
    left = deadline - _clock.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def b64(data: bytes | None) -> str | None:
    return base64.b64encode(data).decode() if data is not None else None


def unb64(data: str | None) -> bytes | None:
    return base64.b64decode(data) if data is not None else None
