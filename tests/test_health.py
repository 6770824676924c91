"""The sidecar's HTTP port and metrics, exercised with real HTTP requests."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from nccl_back import log
from nccl_back.cli import main
from nccl_back.errors import (
    ConfigError,
    HandshakeTimeoutError,
    NcclBackError,
    NoPeerError,
    RegistryError,
    TransferError,
    TransferTimeoutError,
    WeightVerificationError,
)
from nccl_back.metrics import CONTENT_TYPE, FALLBACK_REASONS, Metrics, fallback_reason
from nccl_back.sidecar.drain import request_drain
from nccl_back.sidecar.health import HealthServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """main() (the nccl-back command line) configures logging for the process; undo it
    so other tests see the default."""
    yield
    log.reset()


def get(server: HealthServer, path: str, host: str = "127.0.0.1") -> tuple[int, str, str]:
    """(status, body, content type) of a GET, whatever the status."""
    url = f"http://{host}:{server.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode(), resp.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers["Content-Type"]


def post(port: int, path: str, host: str = "127.0.0.1", timeout: float = 10) -> int:
    req = urllib.request.Request(f"http://{host}:{port}{path}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def server() -> Iterator[HealthServer]:
    with HealthServer(Metrics()) as s:
        yield s


def sample(text: str, name: str, labels: str = "") -> float:
    """The value of one series in Prometheus text, e.g. sample(t, "x_total", 'a="b"')."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{key} not in metrics output")


def test_healthz_answers_while_alive(server: HealthServer) -> None:
    """/healthz answers 200 as soon as the server has started, before any weights."""
    assert get(server, "/healthz")[:2] == (200, "ok\n")


def test_readiness_transitions(server: HealthServer) -> None:
    """/readyz: 503 until ready, 200 when ready, 503 for good once draining."""
    assert get(server, "/readyz")[:2] == (503, "not_ready\n")
    server.set_ready(True)
    assert get(server, "/readyz")[:2] == (200, "ready\n")
    server.set_draining()
    assert get(server, "/readyz")[:2] == (503, "draining\n")
    server.set_ready(True)
    assert get(server, "/readyz")[:2] == (503, "draining\n")
    assert get(server, "/healthz")[0] == 200


def test_ready_gauge_follows_readiness(server: HealthServer) -> None:
    """The nccl_back_ready gauge is 1 only while /readyz answers 200."""
    assert sample(get(server, "/metrics")[1], "nccl_back_ready") == 0
    server.set_ready(True)
    assert sample(get(server, "/metrics")[1], "nccl_back_ready") == 1
    server.set_draining()
    assert sample(get(server, "/metrics")[1], "nccl_back_ready") == 0


def test_metrics_text_after_recording(server: HealthServer) -> None:
    """/metrics serves every recorded metric in Prometheus text with its content type."""
    m = server.metrics
    m.record_load("peer", 1024, 0.7)
    m.record_load("peer", 1024, 1.5)
    m.record_load("storage", 10, 30.0)
    m.record_fallback("handshake_timeout")
    m.record_served(True)
    m.record_served(False)
    m.record_served(False)
    m.record_verification_failure()
    m.record_handshake_timeout()
    m.set_claims(3)
    status, text, ctype = get(server, "/metrics")
    assert status == 200 and ctype == CONTENT_TYPE
    assert sample(text, "nccl_back_loads_total", 'source="peer"') == 2
    assert sample(text, "nccl_back_loads_total", 'source="local"') == 0
    assert sample(text, "nccl_back_loaded_bytes_total", 'source="peer"') == 2048
    assert sample(text, "nccl_back_load_seconds_count", 'source="storage"') == 1
    assert sample(text, "nccl_back_load_seconds_sum", 'source="peer"') == pytest.approx(2.2)
    assert sample(text, "nccl_back_fallbacks_total", 'reason="handshake_timeout"') == 1
    assert sample(text, "nccl_back_fallbacks_total", 'reason="no_peer"') == 0
    assert sample(text, "nccl_back_transfers_served_total", 'outcome="ok"') == 1
    assert sample(text, "nccl_back_transfers_served_total", 'outcome="failed"') == 2
    assert sample(text, "nccl_back_verification_failures_total") == 1
    assert sample(text, "nccl_back_handshake_timeouts_total") == 1
    assert sample(text, "nccl_back_active_claims") == 3


def test_every_fallback_reason_is_exported_at_zero() -> None:
    """Every fallback reason has a series from the start, so rate() works at once."""
    text = Metrics().render().decode()
    for reason in FALLBACK_REASONS:
        assert sample(text, "nccl_back_fallbacks_total", f'reason="{reason}"') == 0


def test_metrics_instances_are_independent() -> None:
    """Two Metrics in one process neither collide on names nor share counts."""
    a, b = Metrics(), Metrics()
    a.record_served(True)
    assert sample(a.render().decode(), "nccl_back_transfers_served_total", 'outcome="ok"') == 1
    assert sample(b.render().decode(), "nccl_back_transfers_served_total", 'outcome="ok"') == 0


def test_unknown_label_values_are_refused() -> None:
    """A source or reason outside the fixed sets raises ConfigError (bounded cardinality)."""
    m = Metrics()
    with pytest.raises(ConfigError, match=r"reason='peer died': choose one of no_peer, "):
        m.record_fallback("peer died")
    with pytest.raises(ConfigError, match=r"source='s3': choose one of peer, storage, local"):
        m.record_load("s3", 1, 1.0)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NoPeerError("none"), "no_peer"),
        (HandshakeTimeoutError("slow"), "handshake_timeout"),
        (TransferTimeoutError("hung"), "transfer_timeout"),
        (TransferError("crashed"), "transfer_error"),
        (WeightVerificationError("layer 3"), "verification_failed"),
        (RegistryError("down"), "registry_error"),
        (RuntimeError("?"), "other"),
    ],
)
def test_fallback_reason_codes(error: BaseException, reason: str) -> None:
    """Each peer-load error maps to its stable reason code, the most specific class first."""
    assert fallback_reason(error) == reason
    assert reason in FALLBACK_REASONS


def test_unknown_path_is_404(server: HealthServer) -> None:
    """Paths other than the three endpoints answer 404."""
    assert get(server, "/")[0] == 404
    assert post(server.port, "/readyz") == 404


def test_port_in_use_is_a_config_error() -> None:
    """Starting on a port another socket listens on raises ConfigError naming the flag."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        expected = f"health port {port} on 127.0.0.1 is already in use; pick another with --health-port"
        with pytest.raises(ConfigError, match=re.escape(expected)):
            HealthServer(Metrics(), port=port).start()


def test_a_second_server_cannot_share_the_port() -> None:
    """A second health server on a running one's port is refused (ConfigError), not
    given a share of its probes, although the first one's listeners share the port."""
    with HealthServer(Metrics()) as first:
        with pytest.raises(ConfigError, match=f"health port {first.port} on 127.0.0.1 is already in use"):
            HealthServer(Metrics(), port=first.port).start()
        for _ in range(20):
            assert get(first, "/healthz")[:2] == (200, "ok\n")


def test_close_releases_the_port() -> None:
    """After close() the same port can be bound again and the old server answers nothing."""
    first = HealthServer(Metrics()).start()
    port = first.port
    first.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    with HealthServer(Metrics(), port=port) as second:
        assert get(second, "/healthz")[0] == 200


def test_drain_blocks_until_callback_returns_and_runs_once() -> None:
    """POST /drain flips /readyz to 503 at once, returns after on_drain, and runs it once."""
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def on_drain() -> None:
        calls.append(1)
        entered.set()
        release.wait(10)

    with HealthServer(Metrics(), on_drain=on_drain) as server:
        server.set_ready(True)
        done = threading.Event()

        def pre_stop() -> None:
            request_drain(server.port, timeout=10)
            done.set()

        hook = threading.Thread(target=pre_stop)
        hook.start()
        assert entered.wait(10)
        assert get(server, "/readyz")[:2] == (503, "draining\n")
        assert get(server, "/healthz")[0] == 200
        assert not done.is_set()
        release.set()
        hook.join(10)
        assert done.is_set()
        assert post(server.port, "/drain") == 200
        assert calls == [1]


def test_failed_drain_is_reported() -> None:
    """An on_drain that raises answers 500 and request_drain raises NcclBackError."""

    def on_drain() -> None:
        raise RuntimeError("in-flight send stuck")

    with HealthServer(Metrics(), on_drain=on_drain) as server, pytest.raises(
        NcclBackError, match=r"drain request to 127\.0\.0\.1:\d+ failed: HTTP Error 500"
    ):
        request_drain(server.port, timeout=5)


def _non_loopback_address() -> str | None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))  # UDP connect sends nothing; it only picks a route
        addr = str(s.getsockname()[0])
        return None if addr.startswith("127.") else addr
    return None


def test_drain_refused_from_other_hosts() -> None:
    """POST /drain from a non-loopback address answers 403 and does not drain."""
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with HealthServer(Metrics(), host="0.0.0.0") as server:
        server.set_ready(True)
        assert post(server.port, "/drain", host=addr) == 403
        assert get(server, "/readyz")[0] == 200


def test_drain_command_line() -> None:
    """`nccl-back drain` drains a live sidecar and fails cleanly on none."""
    with HealthServer(Metrics()) as server:
        assert main(["drain", "--port", str(server.port), "--timeout", "5"]) == 0
        assert server.state == "draining"
        port = server.port
    with pytest.raises(SystemExit) as exit_info:
        main(["drain", "--port", str(port), "--timeout", "2"])
    assert exit_info.value.code == 1


# ------------------------------------------------- slow, idle and hostile clients


class _Dripper(threading.Thread):
    """A client that sends a request one byte at a time, ``interval`` apart, and
    reconnects whenever the server closes it (a persistent slowloris)."""

    def __init__(self, port: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.port, self.interval = port, interval
        self.stop = threading.Event()
        self.connections = 0

    def run(self) -> None:
        payload = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 10_000
        while not self.stop.is_set():
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=5
            ) as s:
                self.connections += 1
                for byte in payload:
                    if self.stop.wait(self.interval):
                        return
                    s.sendall(bytes([byte]))


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data``, half-close, and return everything the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize(
    ("slow", "idle_count", "cap"),
    [(8, 20, 8), (20, 0, 4), (0, 150, 2), (3, 3, 1)],
    ids=["slow-and-idle", "slow-beyond-cap", "idle-flood", "cap-of-one"],
)
def test_probes_answer_under_slow_and_idle_clients(slow: int, idle_count: int, cap: int) -> None:
    """With drip-feeding clients (one byte every 0.5 s, reconnecting when cut) and idle
    connections, up to and beyond the cap, /healthz, /readyz, /metrics and POST /drain
    keep answering, and no more than the cap are ever open."""
    drained: list[bool] = []
    with HealthServer(
        Metrics(), on_drain=lambda: drained.append(True), max_connections=cap, request_timeout=60
    ) as server:
        server.set_ready(True)
        drippers = [_Dripper(server.port, 0.5) for _ in range(slow)]
        for d in drippers:
            d.start()
        idle = [
            socket.create_connection(("127.0.0.1", server.port), timeout=5)
            for _ in range(idle_count)
        ]
        try:
            deadline = time.monotonic() + 60
            while sum(d.connections for d in drippers) < slow:  # every dripper got in once
                assert time.monotonic() < deadline, "drippers never connected"
                time.sleep(0.05)
            for _ in range(5):
                assert get(server, "/healthz")[:2] == (200, "ok\n")
                assert get(server, "/readyz")[:2] == (200, "ready\n")
                assert get(server, "/metrics")[0] == 200
            assert server.open_connections <= cap
            request_drain(server.port, timeout=10)
            assert drained == [True]
            assert get(server, "/readyz")[:2] == (503, "draining\n")
        finally:
            for d in drippers:
                d.stop.set()
            for s in idle:
                s.close()


@pytest.mark.parametrize(
    ("start", "drip"),
    [
        (b"", b"G"),
        (b"GET /healthz HTTP/1.1\r\n", b"X"),
        (b"POST /drain HTTP/1.1\r\nContent-Length: 4000\r\n\r\n", b"x"),
    ],
    ids=["request-line", "headers", "body"],
)
def test_request_past_its_deadline_is_closed(start: bytes, drip: bytes) -> None:
    """A request still arriving at its absolute deadline is answered 408 and closed,
    however steadily its bytes drip in, in its request line, headers or body."""
    with HealthServer(Metrics(), request_timeout=1.0) as server, socket.create_connection(
        ("127.0.0.1", server.port), timeout=10
    ) as s:
        s.sendall(start)
        started = time.monotonic()
        answer = b""
        with contextlib.suppress(ConnectionError):
            while time.monotonic() - started < 30:
                s.sendall(drip)  # a fresh byte every 0.1 s: no single recv ever waits long
                time.sleep(0.1)
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    chunk = s.recv(4096)
                    answer += chunk
                    if not chunk:
                        break
                s.setblocking(True)
        assert time.monotonic() - started < 30, "the dripping request was never cut off"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")


def test_connections_beyond_the_cap_evict_the_oldest() -> None:
    """Idle connections beyond max_connections are closed (oldest first); a new probe
    still gets in at once."""
    with HealthServer(Metrics(), max_connections=4, request_timeout=60) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(30)]
        try:
            deadline = time.monotonic() + 30
            while server.open_connections != 4:
                assert time.monotonic() < deadline, f"{server.open_connections} open"
                time.sleep(0.05)
            idle[0].settimeout(10)
            assert idle[0].recv(1) == b""  # the oldest was closed by the server
            assert get(server, "/healthz")[:2] == (200, "ok\n")
            assert server.open_connections <= 4
        finally:
            for s in idle:
                s.close()


def test_running_drain_outlives_the_request_deadline() -> None:
    """A POST /drain whose callback runs longer than request_timeout still gets its 200,
    and probes answer meanwhile."""
    release = threading.Event()
    with HealthServer(Metrics(), on_drain=lambda: release.wait(30), request_timeout=0.5) as server:
        done: list[int] = []
        hook = threading.Thread(target=lambda: done.append(post(server.port, "/drain", timeout=30)))
        hook.start()
        deadline = time.monotonic() + 30
        while server.state != "draining":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(1.0)  # past the request deadline while the callback runs
        assert get(server, "/healthz")[0] == 200
        release.set()
        hook.join(30)
        assert done == [200]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"POST /drain HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /drain HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
        (b"DELETE /healthz HTTP/1.1\r\n\r\n", 405),
        (b"GET http://x/healthz HTTP/1.1\r\n\r\n", 400),
        (b"GET /healthz HTTP/2.0\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\n folded\r\n\r\n", 400),
    ],
)
def test_malformed_requests_get_a_4xx(request_bytes: bytes, status: int) -> None:
    """Each malformed or oversized request is answered with its 4xx, not served."""
    with HealthServer(Metrics()) as server:
        answer = _raw(server.port, request_bytes)
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:80]
        assert get(server, "/healthz")[0] == 200
