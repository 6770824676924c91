"""A bandwidth-limited HTTP proxy: cloud storage's bandwidth on loopback (demo, benchmarks).

Forwards every request upstream (the GCS emulator), reads the response at upstream
speed and sends it on throttled: all connections' response bytes share one token bucket,
as a fleet shares a bucket's egress; one proxy per worker gives each its own link.
Workers reach it through ``STORAGE_EMULATOR_HOST``. Standard library only.

Run: ``.venv/bin/python -m nccl_back.dev.throttle --upstream http://127.0.0.1:9023 --gbps 0.1``
(prints ``listening on http://127.0.0.1:PORT`` once it accepts connections).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import re
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

#: Bytes forwarded per token-bucket take: small enough that concurrent downloads
#: interleave fairly, large enough that the proxy's own overhead stays negligible.
PIECE = 256 << 10

#: The bucket's depth in seconds of the rate (see :func:`serve`).
BURST_SECONDS = 0.1
#: Seconds one upstream request may take.
_UPSTREAM_TIMEOUT = 60.0

#: Hop-by-hop headers (RFC 9110 §7.6.1) are per connection and never forwarded.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer",
              "transfer-encoding", "upgrade"}


class TokenBucket:
    """Aggregate rate limit: ``take(n)`` blocks until ``n`` more bytes fit under ``rate``.

    A virtual-time (GCRA) bucket: each take reserves the next ``n / rate`` seconds in
    arrival order (fair); ``burst`` bytes may go out ahead of the schedule.
    """

    def __init__(
        self, rate: float, burst: float = PIECE, *,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate {rate} and burst {burst} must be positive")
        self.rate, self.burst = rate, burst
        self._clock, self._sleep = clock, sleep
        self._tat = 0.0  # when the bytes reserved so far will have been paid for
        self._lock = threading.Lock()
        self.taken = 0
        """Bytes taken so far (what went through the link)."""

    def take(self, n: int) -> None:
        with self._lock:
            self.taken += n
            now = self._clock()
            self._tat = max(self._tat, now) + n / self.rate
            wait = self._tat - self.burst / self.rate - now
        if wait > 0:
            self._sleep(wait)


_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
#: An upstream answer: status, reason, headers, body.
_Response = tuple[int, str, list[tuple[str, str]], bytes]


class GetCache:
    """Successful GET responses by path, each fetched whole from upstream once (ranged
    GETs answered from it), shareable by several proxies. Only for objects that do not
    change: then the token bucket, not the emulator's serial server, is the limit.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], _Response] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str], fetch: Callable[[], _Response]) -> _Response:
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # concurrent requests for one key wait for the first fetch
            hit = self._entries.get(key)
            if hit is not None:
                return hit
            entry = fetch()
            if 200 <= entry[0] < 300:
                self._entries[key] = entry
            return entry


def make_handler(
    upstream: str, bucket: TokenBucket, cache: bool | GetCache = False
) -> type[BaseHTTPRequestHandler]:
    """A request handler class forwarding to ``upstream`` (``http://host:port``)."""
    up = urlparse(upstream)
    if up.scheme != "http" or not up.hostname or not up.port:
        raise ValueError(f"upstream {upstream!r}: expected http://host:port")
    host, port = up.hostname, up.port
    gets = cache if isinstance(cache, GetCache) else GetCache() if cache else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # one line per request would drown the benchmark's output

        def _forward(self) -> None:
            if isinstance(self.server, Proxy):
                self.server.requests += 1
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                self.send_error(501, "chunked request bodies are not supported")
                return
            body_len = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(body_len) if body_len else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            started = False
            try:
                def fetch() -> _Response:
                    conn = http.client.HTTPConnection(host, port, timeout=_UPSTREAM_TIMEOUT)
                    try:
                        conn.request(self.command, self.path, body=body, headers=headers)
                        resp = conn.getresponse()
                        # Read the whole body at upstream speed first: the emulator serves
                        # one request at a time, so throttling while it writes would make
                        # its serial server, not the token bucket, the shared bottleneck.
                        return resp.status, resp.reason, resp.getheaders(), resp.read()
                    finally:
                        conn.close()

                ranged = _RANGE.fullmatch(self.headers.get("Range", "").strip())
                if gets is not None and self.command == "GET":
                    headers.pop("Range", None)
                    headers.pop("range", None)
                    status, reason, resp_headers, data = gets.get((self.path, ""), fetch)
                    if ranged and status == 200:
                        status, reason, resp_headers, data = _slice(
                            resp_headers, data, int(ranged[1]), ranged[2])
                else:
                    status, reason, resp_headers, data = fetch()
                started = True
                self.send_response(status, reason)
                length: str | None = None
                for k, v in resp_headers:
                    if k.lower() == "content-length":
                        length = v
                    elif k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                if self.command != "HEAD":
                    length = str(len(data))
                if length is not None:
                    self.send_header("Content-Length", length)
                self.end_headers()
                view = memoryview(data)
                for i in range(0, len(data), PIECE):
                    piece = view[i:i + PIECE]
                    bucket.take(len(piece))
                    self.wfile.write(piece)
            except (OSError, http.client.HTTPException) as e:
                self.close_connection = True
                # Once the response has begun, closing the connection is the only signal.
                if not started:
                    with contextlib.suppress(OSError):
                        self.send_error(502, f"upstream failed: {e}")

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

    return Handler


def _slice(headers: list[tuple[str, str]], data: bytes, first: int, last: str) -> _Response:
    """The 206 answer to ``Range: bytes=first-last`` from the whole object's response."""
    end = min(int(last) + 1 if last else len(data), len(data))
    if first >= len(data):
        return 416, "Range Not Satisfiable", [("Content-Range", f"bytes */{len(data)}")], b""
    # The object's hashes describe all of it, never a slice: a client must not check them.
    kept = [(k, v) for k, v in headers
            if k.lower() not in ("content-length", "content-range", "x-goog-hash")]
    return 206, "Partial Content", [*kept, ("Content-Range", f"bytes {first}-{end - 1}/{len(data)}")
                                    ], data[first:end]


class Proxy(ThreadingHTTPServer):
    """A running proxy; ``bucket.taken`` says how many response bytes it sent,
    ``requests`` how many requests it answered (GETs, listings, metadata)."""

    bucket: TokenBucket
    requests: int = 0


def serve(
    upstream: str, gbps: float, port: int = 0, host: str = "127.0.0.1", *,
    cache: bool | GetCache = False,
) -> Proxy:
    """A started-in-a-thread proxy limited to ``gbps`` GB/s (10^9 bytes/s) in aggregate;
    ``cache``: serve repeated GETs from memory (a :class:`GetCache` given is shared)."""
    # A burst of 0.1 s of bytes lets a sender that the OS scheduled late catch up, so
    # CPU contention does not eat into the configured rate; the long-run rate is exact.
    bucket = TokenBucket(gbps * 1e9, burst=max(PIECE, gbps * 1e9 * BURST_SECONDS))
    server = Proxy((host, port), make_handler(upstream, bucket, cache=cache))
    server.bucket = bucket
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="throttle").start()
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--upstream", required=True, help="http://host:port of the storage server")
    parser.add_argument("--gbps", type=float, required=True, help="aggregate limit in GB/s (10^9 B/s)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--cache", action="store_true",
                        help="fetch each GET (path, Range) from upstream once (immutable data only)")
    args = parser.parse_args()
    if not args.gbps > 0:
        parser.error("--gbps must be positive")
    server = serve(args.upstream, args.gbps, args.port, cache=args.cache)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
