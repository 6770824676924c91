"""The sidecar's one HTTP port: liveness, readiness, metrics and a local drain trigger.

========================  =====================================================
``GET /healthz``          200 while the process is alive (liveness probe)
``GET /readyz``           200 once weights are loaded, verified and published;
                          503 before that and from the moment draining starts
``GET /metrics``          Prometheus text of the service's :class:`Metrics`
``POST /drain``           loopback clients only, with the drain token when one
                          is set (header ``X-Drain-Token``): start draining and,
                          if the service gave an ``on_drain`` callback, block
                          until it returns (a Kubernetes ``preStop`` hook calls
                          this, so in-flight transfers finish before SIGTERM)
========================  =====================================================

The server binds 127.0.0.1 unless told otherwise; in a pod it must bind the pod's
address (``0.0.0.0``) for the kubelet's probes to reach it. ``/drain`` checks the
client address itself, so binding wider never lets another pod drain this one; every
container of the pod shares its loopback, so the sidecar also sets a drain token,
written to a 0600 file (:func:`write_token_file`) that only its own user can read.

Requests run on a bounded pool of threads; a connection that finds them all busy is
closed at once, so a flood costs the flooder, not the process (probes retry).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hmac
import ipaddress
import os
import secrets
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from .errors import ConfigError, NcclBackError
from .log import get_logger
from .metrics import CONTENT_TYPE, Metrics

# A client that connects and sends nothing must not hold a handler thread forever.
REQUEST_TIMEOUT = 10.0
#: Threads answering requests; a connection beyond them is closed unanswered.
MAX_THREADS = 8
#: Header carrying the drain token.
TOKEN_HEADER = "X-Drain-Token"
_MAX_TOKEN_FILE = 1024


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT

    def do_GET(self) -> None:
        self._get(send_body=True)

    def do_HEAD(self) -> None:
        self._get(send_body=False)

    def _get(self, send_body: bool) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._reply(200, b"ok\n", send_body=send_body)
        elif path == "/readyz":
            state = owner.state
            self._reply(200 if state == "ready" else 503, f"{state}\n".encode(), send_body=send_body)
        elif path == "/metrics":
            self._reply(200, owner.metrics.render(), CONTENT_TYPE, send_body)
        else:
            self._reply(404, b"not found; try /healthz, /readyz or /metrics\n", send_body=send_body)

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/drain":
            self._reply(404, b"not found; POST /drain is the only action\n")
            return
        if not ipaddress.ip_address(self.client_address[0]).is_loopback:
            self._reply(403, b"/drain is accepted from loopback clients only\n")
            return
        expected = self.server.owner.drain_token
        given = self.headers.get(TOKEN_HEADER, "")
        if expected is not None and not hmac.compare_digest(given.encode(), expected.encode()):
            get_logger(__name__).warning("drain_refused", reason="token")
            self._reply(403, f"/drain needs the drain token in {TOKEN_HEADER}\n".encode())
            return
        try:
            self.server.owner.drain()
        except Exception as e:  # the callback is the service's; report, don't crash the server
            get_logger(__name__).error("drain_failed", error=repr(e))
            self._reply(500, f"drain failed: {e}\n".encode())
            return
        self._reply(200, b"drained\n")

    def _reply(
        self,
        code: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        send_body: bool = True,
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Probes hit this every few seconds; http.server would print each to stderr.
        pass


class _Server(HTTPServer):
    """An HTTP server whose requests run on a bounded pool (``ThreadingHTTPServer``
    starts one thread per connection, without limit)."""

    # A burst of connections waits in the kernel's queue, not in SYN retries.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], owner: HealthServer, threads: int) -> None:
        self.owner = owner
        self._slots = threading.BoundedSemaphore(threads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="nccl-back-health")
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # Every thread is busy (a flood, or slow clients): refuse rather than queue.
            self.shutdown_request(request)
            return
        try:
            self._pool.submit(self._work, request, client_address)
        except RuntimeError:  # closing
            self._slots.release()
            self.shutdown_request(request)

    def _work(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to stderr; a client's reset is no error of ours.
        get_logger(__name__).debug("health_request_failed", client=str(client_address))

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class HealthServer:
    """Serves ``/healthz``, ``/readyz``, ``/metrics`` and ``POST /drain`` from a daemon thread.

    ``on_drain`` (optional) is called once by the first ``POST /drain``: the service
    withdraws from the registry, refuses new claims and waits for in-flight sends.
    With ``drain_token``, ``POST /drain`` must carry it (header ``X-Drain-Token``).
    At most ``max_threads`` requests are answered at once.
    """

    def __init__(
        self,
        metrics: Metrics,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        on_drain: Callable[[], None] | None = None,
        drain_token: str | None = None,
        max_threads: int = MAX_THREADS,
    ) -> None:
        if max_threads < 1:
            raise ConfigError(f"max_threads={max_threads!r}: must be at least 1")
        self.metrics = metrics
        self.drain_token = drain_token
        self.max_threads = max_threads
        self.host = host
        self._requested_port = port
        self._on_drain = on_drain
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._ready = False
        self._draining = False
        self._drained = False
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when constructed with ``port=0``)."""
        if self._server is None:
            raise NcclBackError("HealthServer.port is known only after start()")
        return int(self._server.server_address[1])

    @property
    def state(self) -> str:
        """``ready``, ``not_ready`` or ``draining`` (what ``/readyz`` answers)."""
        with self._lock:
            if self._draining:
                return "draining"
            return "ready" if self._ready else "not_ready"

    def start(self) -> HealthServer:
        """Bind and serve in a daemon thread; a port in use raises :class:`ConfigError`."""
        try:
            self._server = _Server((self.host, self._requested_port), self, self.max_threads)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"health port {self._requested_port} on {self.host} is already in use;"
                    " pick another with --health-port"
                ) from e
            raise ConfigError(
                f"cannot listen on {self.host}:{self._requested_port} for health checks ({e});"
                " check --health-host and --health-port"
            ) from e
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"nccl-back-health-{self.port}",
            daemon=True,
        )
        self._thread.start()
        get_logger(__name__).info("health_server_started", host=self.host, port=self.port)
        return self

    def set_ready(self, flag: bool) -> None:
        """Ready once weights are loaded, verified and published; ignored while draining."""
        with self._lock:
            self._ready = flag
            effective = flag and not self._draining
        self.metrics.set_ready(effective)

    def set_draining(self) -> None:
        """From now on ``/readyz`` answers 503, for good."""
        with self._lock:
            self._draining = True
        self.metrics.set_ready(False)

    def drain(self) -> None:
        """Start draining and run ``on_drain`` once; concurrent callers wait for that run."""
        self.set_draining()
        with self._drain_lock:
            if self._drained:
                return
            if self._on_drain is not None:
                self._on_drain()
            self._drained = True
            get_logger(__name__).info("drained")

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the port."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = None
        self._thread = None

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_token_file(path: str, token: str | None = None) -> str:
    """Write a drain token (a fresh random one by default) to ``path``, mode 0600,
    atomically; returns it. The directory must be private (see ``handoff.private_dir``)
    or :class:`ConfigError` says why."""
    from .errors import AttachError
    from .handoff import private_dir

    token = token or secrets.token_urlsafe(32)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        private_dir(directory, create=True)
    except AttachError as e:
        raise ConfigError(f"drain token file {path}: {e}") from e
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return token


def read_token_file(path: str) -> str:
    """The drain token in ``path``; :class:`ConfigError` if it is missing, too large,
    or readable by anyone but its owner."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"drain token file {path}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise ConfigError(
                f"drain token file {path}: must be a regular file of mode 0600"
                f" (is {st.st_mode & 0o7777:o})"
            )
        data = f.read(_MAX_TOKEN_FILE + 1)
    if not data or len(data) > _MAX_TOKEN_FILE:
        raise ConfigError(f"drain token file {path}: empty or over {_MAX_TOKEN_FILE} bytes")
    return data.decode("utf-8", "replace").strip()


def request_drain(
    port: int, timeout: float, host: str = "127.0.0.1", token: str | None = None
) -> None:
    """Ask the local sidecar on ``port`` to drain (with its drain ``token`` when it has
    one); returns once it has (or raises)."""
    headers = {TOKEN_HEADER: token} if token is not None else {}
    req = urllib.request.Request(f"http://{host}:{port}/drain", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as e:
        raise NcclBackError(f"drain request to {host}:{port} failed: {e}") from e


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nccl_back.health drain --port P --timeout S``: a preStop hook."""
    parser = argparse.ArgumentParser(prog="python -m nccl_back.health")
    sub = parser.add_subparsers(dest="command", required=True)
    drain = sub.add_parser("drain", help="drain the local sidecar and wait until it has")
    drain.add_argument("--port", type=int, default=9400)
    drain.add_argument("--timeout", type=float, default=130.0, help="seconds to wait at most")
    drain.add_argument("--token-file", help="file holding the sidecar's drain token")
    args = parser.parse_args(argv)
    try:
        token = read_token_file(args.token_file) if args.token_file else None
        request_drain(args.port, args.timeout, token=token)
    except NcclBackError as e:
        parser.exit(1, f"{e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
