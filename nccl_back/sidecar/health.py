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
written to a 0600 file (:mod:`nccl_back.sidecar.drain`) that only its own user can read.

Why not ``http.server``: its timeout bounds each ``recv``, not a request, so clients
that drip one byte every few seconds hold its handler threads for ever and the probes
stop answering (the hardening review, finding 6). Here one thread multiplexes every
connection with a selector and never blocks on a client, so no number of slow or idle
clients can starve a probe:

- each connection has an absolute deadline, ``request_timeout`` from its accept to the
  last byte of the reply (a ``POST /drain`` that is running its callback is exempt
  while it runs, then gets a fresh one to send the reply); past it the connection gets
  a best-effort ``408`` and is closed;
- at most ``max_connections`` are open; a new one beyond that evicts the oldest
  connection that has not finished sending its request (the slow and idle ones are the
  oldest), so a new probe always gets in;
- requests are parsed by :mod:`nccl_back.sidecar.http` under its limits (head, headers,
  body); no chunked bodies, no keep-alive (every reply says ``Connection: close``);
- the only slow handler, the drain callback, runs on its own thread, never on the loop.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import selectors
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from nccl_back import _clock
from nccl_back.errors import ConfigError, NcclBackError
from nccl_back.log import get_logger
from nccl_back.metrics import CONTENT_TYPE, Metrics
from nccl_back.sidecar.http import (
    MAX_HEAD_BYTES,
    TEXT,
    TOKEN_HEADER,
    BadRequest,
    Request,
    parse_request,
    response,
)

#: Seconds from a connection's accept to the last byte of its reply, absolute.
REQUEST_TIMEOUT = 10.0
#: Open connections at most; a new one beyond that evicts the oldest unfinished request.
MAX_CONNECTIONS = 64
# Accepts per loop turn: a connect flood cannot keep the loop from serving requests.
_ACCEPT_BURST = 16
# Longest sleep of the loop with nothing to do (deadlines and close() wake it sooner).
_IDLE_TICK = 0.5


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    client: str
    deadline: float | None
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytes = b""
    sent: int = 0
    state: str = "reading"  # reading -> (draining ->) writing -> closed
    registered: bool = False


class _Loop:
    """One thread, one selector: accepts, reads, parses, answers and expires every
    connection of the health port (see the module docstring)."""

    def __init__(
        self, owner: HealthServer, listener: socket.socket, max_connections: int, timeout: float
    ) -> None:
        self.owner = owner
        self.listener = listener
        self.max_connections = max_connections
        self.timeout = timeout
        self.stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Insertion order is accept order: the first unfinished entry is the oldest.
        self._conns: dict[int, _Conn] = {}
        self._done: list[tuple[_Conn, bytes]] = []
        self._done_lock = threading.Lock()
        # The drain callback may block for minutes: never on the loop.
        self._drainer = ThreadPoolExecutor(1, thread_name_prefix="nccl-back-drain")
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._log = get_logger(__name__)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the loop is awake anyway
            self._wake_w.send(b"x")

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for key, events in self._sel.select(self._next_timeout()):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._guarded(key.data, events)
                self._finish_drains()
                self._expire()
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._sel.close()
            self.listener.close()
            self._wake_r.close()
            self._wake_w.close()
            self._drainer.shutdown(wait=False, cancel_futures=True)

    def _guarded(self, conn: _Conn, events: int) -> None:
        if conn.state == "closed":  # evicted earlier in this turn
            return
        try:
            if events & selectors.EVENT_READ and conn.state == "reading":
                self._read(conn)
            if events & selectors.EVENT_WRITE and conn.state == "writing":
                self._flush(conn)
        except Exception:  # one client's trouble never stops the loop
            self._log.exception("health_request_failed", client=conn.client)
            self._close(conn)

    def _next_timeout(self) -> float:
        deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None]
        if not deadlines:
            return _IDLE_TICK
        return min(max(min(deadlines) - _clock.monotonic(), 0.0), _IDLE_TICK)

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: keep serving who is in
                self._log.warning("health_accept_failed", error=str(e))
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                # The oldest still sending its request; else the oldest being answered.
                victim = next((c for c in self._conns.values() if c.state == "reading"), None)
                victim = victim or next(
                    (c for c in self._conns.values() if c.state == "writing"), None
                )
                if victim is None:  # every slot waits on an authorized drain
                    sock.close()
                    continue
                self._log.debug("health_connection_evicted", client=victim.client)
                self._close(victim)
            conn = _Conn(sock, str(addr[0]), _clock.monotonic() + self.timeout)
            self._conns[id(conn)] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            conn.registered = True

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(MAX_HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not chunk:
            self._close(conn)
            return
        conn.inbox += chunk
        try:
            request = parse_request(bytes(conn.inbox))
        except BadRequest as e:
            self._reply(conn, e.status, f"{e.reason}\n".encode())
            return
        if request is not None:
            self._dispatch(conn, request)

    def _dispatch(self, conn: _Conn, request: Request) -> None:
        owner = self.owner
        if request.method in ("GET", "HEAD"):
            send_body = request.method == "GET"
            if request.path == "/healthz":
                self._reply(conn, 200, b"ok\n", send_body=send_body)
            elif request.path == "/readyz":
                state = owner.state
                self._reply(conn, 200 if state == "ready" else 503, f"{state}\n".encode(),
                            send_body=send_body)
            elif request.path == "/metrics":
                self._reply(conn, 200, owner.metrics.render(), CONTENT_TYPE, send_body)
            else:
                self._reply(conn, 404, b"not found; try /healthz, /readyz or /metrics\n",
                            send_body=send_body)
        elif request.method == "POST":
            if request.path != "/drain":
                self._reply(conn, 404, b"not found; POST /drain is the only action\n")
            elif not _is_loopback(conn.client):
                self._reply(conn, 403, b"/drain is accepted from loopback clients only\n")
            elif owner.drain_token is not None and not hmac.compare_digest(
                request.headers.get(TOKEN_HEADER.lower(), "").encode("latin-1"),
                owner.drain_token.encode(),
            ):
                self._log.warning("drain_refused", reason="token")
                self._reply(conn, 403, f"/drain needs the drain token in {TOKEN_HEADER}\n".encode())
            else:
                self._start_drain(conn)
        else:
            self._reply(conn, 405, b"only GET, HEAD and POST\n")

    def _start_drain(self, conn: _Conn) -> None:
        conn.state = "draining"
        conn.deadline = None  # the callback's own bound applies, not a client's
        self._unregister(conn)
        try:
            future = self._drainer.submit(self.owner.drain)
        except RuntimeError:  # closing
            self._close(conn)
            return
        future.add_done_callback(lambda f: self._drain_done(conn, f))

    def _drain_done(self, conn: _Conn, future: Future[None]) -> None:
        # Runs on the drain thread: hand the reply to the loop.
        error = None if future.cancelled() else future.exception()
        if future.cancelled():
            reply = response(503, b"server closing\n", TEXT, True)
        elif error is not None:  # the callback is the service's; report, don't crash
            self._log.error("drain_failed", error=repr(error))
            reply = response(500, f"drain failed: {error}\n".encode(), TEXT, True)
        else:
            reply = response(200, b"drained\n", TEXT, True)
        with self._done_lock:
            self._done.append((conn, reply))
        self.wake()

    def _finish_drains(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
        for conn, reply in done:
            if conn.state == "draining":
                conn.deadline = _clock.monotonic() + self.timeout
                self._send(conn, reply)

    def _expire(self) -> None:
        now = _clock.monotonic()
        for conn in list(self._conns.values()):
            if conn.deadline is not None and now >= conn.deadline:
                self._log.debug("health_request_timed_out", client=conn.client, state=conn.state)
                if conn.state == "reading":
                    with contextlib.suppress(OSError):  # best effort: it is too slow anyway
                        conn.sock.send(response(408, b"request timed out\n", TEXT, True))
                self._close(conn)

    def _reply(
        self, conn: _Conn, code: int, body: bytes, content_type: str = TEXT,
        send_body: bool = True,
    ) -> None:
        self._send(conn, response(code, body, content_type, send_body))

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.state, conn.outbox, conn.sent = "writing", data, 0
        self._flush(conn)
        if conn.state == "writing":
            if conn.registered:
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
            else:
                self._sel.register(conn.sock, selectors.EVENT_WRITE, conn)
                conn.registered = True

    def _flush(self, conn: _Conn) -> None:
        try:
            conn.sent += conn.sock.send(memoryview(conn.outbox)[conn.sent :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if conn.sent >= len(conn.outbox):
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
                # Unread input would make close() send a reset that can destroy the
                # reply in flight: discard what has already arrived.
                conn.sock.recv(1 << 16)
            self._close(conn)

    def _unregister(self, conn: _Conn) -> None:
        if conn.registered:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
            conn.registered = False

    def _close(self, conn: _Conn) -> None:
        if conn.state == "closed":
            return
        conn.state = "closed"
        self._unregister(conn)
        self._conns.pop(id(conn), None)
        with contextlib.suppress(OSError):
            conn.sock.close()


def _is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


class HealthServer:
    """Serves ``/healthz``, ``/readyz``, ``/metrics`` and ``POST /drain`` from a daemon thread.

    ``on_drain`` (optional) is called once by the first ``POST /drain``: the service
    withdraws from the registry, refuses new claims and waits for in-flight sends.
    With ``drain_token``, ``POST /drain`` must carry it (header ``X-Drain-Token``).
    At most ``max_connections`` connections are open at once, each for at most
    ``request_timeout`` seconds (see the module docstring).
    """

    def __init__(
        self,
        metrics: Metrics,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        on_drain: Callable[[], None] | None = None,
        drain_token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        if not isinstance(max_connections, int) or max_connections < 1:
            raise ConfigError(f"max_connections={max_connections!r}: must be at least 1")
        if not request_timeout > 0:
            raise ConfigError(f"request_timeout={request_timeout!r}: must be positive seconds")
        self.metrics = metrics
        self.drain_token = drain_token
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.host = host
        self._requested_port = port
        self._on_drain = on_drain
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._ready = False
        self._draining = False
        self._drained = False
        self._loop: _Loop | None = None
        self._port: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when constructed with ``port=0``)."""
        if self._port is None:
            raise NcclBackError("HealthServer.port is known only after start()")
        return self._port

    @property
    def open_connections(self) -> int:
        """Connections open right now (at most ``max_connections``)."""
        return self._loop.open_connections if self._loop is not None else 0

    @property
    def state(self) -> str:
        """``ready``, ``not_ready`` or ``draining`` (what ``/readyz`` answers)."""
        with self._lock:
            if self._draining:
                return "draining"
            return "ready" if self._ready else "not_ready"

    def start(self) -> HealthServer:
        """Bind and serve in a daemon thread; a port in use raises :class:`ConfigError`."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A restarted sidecar rebinds its port at once, despite TIME_WAIT leftovers.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self._requested_port))
            # A burst of connections waits in the kernel's queue, not in SYN retries.
            listener.listen(128)
            listener.setblocking(False)
        except OSError as e:
            listener.close()
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"health port {self._requested_port} on {self.host} is already in use;"
                    " pick another with --health-port"
                ) from e
            raise ConfigError(
                f"cannot listen on {self.host}:{self._requested_port} for health checks ({e});"
                " check --health-host and --health-port"
            ) from e
        self._port = int(listener.getsockname()[1])
        self._loop = _Loop(self, listener, self.max_connections, self.request_timeout)
        self._thread = threading.Thread(
            target=self._loop.run,
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
        if self._loop is None:
            return
        self._loop.stop.set()
        self._loop.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._loop = None
        self._thread = None

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
