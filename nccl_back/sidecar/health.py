"""The sidecar's one HTTP port: liveness, readiness, metrics and a local drain trigger.

``GET /healthz`` 200 while alive; ``GET /readyz`` 200 once weights are loaded, verified
and published, 503 before and from the drain's start; ``GET /metrics`` Prometheus text;
``POST /drain`` (loopback clients, with ``X-Drain-Token`` when set) drains and blocks
until ``on_drain`` returns (a ``preStop`` hook: in-flight transfers finish before SIGTERM).

In a pod it binds the pod's address (``0.0.0.0``) for the kubelet; ``/drain`` checks
the client address itself, so binding wider never lets another pod drain this one, and
the pod's other containers (sharing its loopback) need the 0600 token file
(:mod:`nccl_back.sidecar.drain`).

Not ``http.server``: its timeout bounds each ``recv``, not a request, so clients that
drip bytes hold its threads for ever. Connections are served by
:mod:`nccl_back.sidecar.loop`, parsed by :mod:`nccl_back.sidecar.http` (bounded, no
chunked bodies, no keep-alive); the drain callback runs on its own thread.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import resource
import threading
from collections.abc import Callable

from nccl_back.errors import ConfigError, NcclBackError
from nccl_back.log import get_logger
from nccl_back.metrics import CONTENT_TYPE, Metrics
from nccl_back.sidecar.http import TEXT, TOKEN_HEADER, Request, response
from nccl_back.sidecar.loop import Answer, Loop, bind
from nccl_back.timing import HEALTH_REQUEST_TIMEOUT as REQUEST_TIMEOUT

#: Open connections at most; a new one beyond that evicts the oldest unfinished request.
MAX_CONNECTIONS = 1024


def connection_cap(requested: int) -> int:
    """``requested``, or a quarter of the soft file descriptor limit if that is less
    (at least 16): the health port never takes the descriptors the load needs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return min(requested, max(16, soft // 4))


def _is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


class HealthServer:
    """Serves ``/healthz``, ``/readyz``, ``/metrics`` and ``POST /drain`` from a daemon thread.

    The first ``POST /drain`` (carrying ``drain_token`` if set) calls ``on_drain`` once.
    At most ``max_connections`` are open (:func:`connection_cap`), each for at most
    ``request_timeout`` seconds.
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
        self.max_connections = connection_cap(max_connections)
        self.request_timeout = request_timeout
        self.host = host
        self._requested_port = port
        self._on_drain = on_drain
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._ready = False
        self._draining = False
        self._drained = False
        self._loop: Loop | None = None
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
        try:
            listeners = bind(self.host, self._requested_port)
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
        self._port = int(listeners[0].getsockname()[1])
        self._loop = Loop(listeners, self._answer, max_connections=self.max_connections,
                          timeout=self.request_timeout)
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

    def _answer(self, client: str, request: Request) -> Answer:
        """The reply to one request (on the loop: never blocks), or the drain to run."""
        if request.method in ("GET", "HEAD"):
            body = request.method == "GET"
            if request.path == "/healthz":
                return response(200, b"ok\n", TEXT, body)
            if request.path == "/readyz":
                state = self.state
                return response(200 if state == "ready" else 503, f"{state}\n".encode(), TEXT, body)
            if request.path == "/metrics":
                return response(200, self.metrics.render(), CONTENT_TYPE, body)
            return response(404, b"not found; try /healthz, /readyz or /metrics\n", TEXT, body)
        if request.method != "POST":
            return response(405, b"only GET, HEAD and POST\n", TEXT, True)
        if request.path != "/drain":
            return response(404, b"not found; POST /drain is the only action\n", TEXT, True)
        if not _is_loopback(client):
            return response(403, b"/drain is accepted from loopback clients only\n", TEXT, True)
        if self.drain_token is not None and not hmac.compare_digest(
            request.headers.get(TOKEN_HEADER.lower(), "").encode("latin-1"),
            self.drain_token.encode(),
        ):
            get_logger(__name__).warning("drain_refused", reason="token")
            return response(403, f"/drain needs the drain token in {TOKEN_HEADER}\n".encode(),
                            TEXT, True)
        return self._drain_reply

    def _drain_reply(self) -> bytes:
        # Off the loop: the callback is the service's and may take the drain bound.
        try:
            self.drain()
        except Exception as error:  # report it to the hook, don't crash the server
            get_logger(__name__).error("drain_failed", error=repr(error))
            return response(500, f"drain failed: {error}\n".encode(), TEXT, True)
        return response(200, b"drained\n", TEXT, True)

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
