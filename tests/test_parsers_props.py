"""Property tests of every parser of outside data in the sidecar's doors: the health
port's HTTP request parser, the hand-off protocol (both directions), Redis URLs and
``Settings.from_env`` / ``Settings(...)``.

Each parser gets arbitrary input and mutations of valid input; the property is always
the same: a valid result or the parser's typed error (a 4xx for HTTP), never another
exception, and valid input round-trips. Real sockets, a real hand-off server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from nccl_back.config import ENV_PREFIX, SECRET_FILE_ENV, Settings
from nccl_back.errors import AttachError, ConfigError, WeightVerificationError
from nccl_back.metrics import Metrics
from nccl_back.model.skeleton import build, manifest
from nccl_back.redis_url import RedisTarget, parse_redis_url
from nccl_back.sidecar.handoff import PROTOCOL, HandoffServer, attach
from nccl_back.sidecar.health import HealthServer
from nccl_back.sidecar.http import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    BadRequest,
    Request,
    parse_request,
)

pytestmark = pytest.mark.timeout(300)
FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with a few bytes replaced, inserted or deleted."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        at = draw(st.integers(0, len(data)))
        if op == "replace" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


# ------------------------------------------------------------------ HTTP requests

_TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[Request, bytes]:
    """A valid request and its bytes on the wire."""
    method = draw(st.sampled_from(["GET", "HEAD", "POST"]))
    target = "/" + draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40))
    names = draw(st.lists(st.text(_TCHAR, min_size=1, max_size=12), max_size=8,
                          unique_by=str.lower))
    names = [n for n in names if n.lower() not in ("content-length", "transfer-encoding")]
    value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
        lambda v: v.strip(" \t")
    )
    headers = {n: draw(value) for n in names}
    body = draw(st.binary(max_size=64)) if method == "POST" else b""
    lines = [f"{method} {target} HTTP/1.1"] + [f"{n}: {v}" for n, v in headers.items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    wire = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    expected = {n.lower(): v for n, v in headers.items()}
    if body:
        expected["content-length"] = str(len(body))
    return Request(method, target, "HTTP/1.1", expected, body), wire


def _parse_or_4xx(data: bytes) -> Request | None:
    try:
        return parse_request(data)
    except BadRequest as e:
        assert 400 <= e.status < 500 and e.reason
        return None


@settings(max_examples=200, deadline=None)
@given(http_requests())
def test_valid_http_requests_round_trip(case: tuple[Request, bytes]) -> None:
    """A valid request parses to what was sent; every strict prefix of it is incomplete."""
    request, wire = case
    assert parse_request(wire) == request
    assert parse_request(wire + b"GET /trailing HTTP/1.1\r\n") == request  # no pipelining
    for cut in sorted({0, 1, len(wire) // 2, len(wire) - 1}):
        assert parse_request(wire[:cut]) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=MAX_HEAD_BYTES + MAX_BODY_BYTES + 100))
def test_arbitrary_bytes_give_a_request_none_or_4xx(data: bytes) -> None:
    """Any bytes parse to a request, to 'incomplete', or to a BadRequest with a 4xx."""
    _parse_or_4xx(data)
    _parse_or_4xx(data + b"\r\n\r\n")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_http_requests_give_a_request_none_or_4xx(data: st.DataObject) -> None:
    """Valid requests with bytes replaced, inserted or deleted never raise anything but
    BadRequest (4xx), and a result that parses obeys every limit."""
    _, wire = data.draw(http_requests())
    result = _parse_or_4xx(data.draw(mutated(wire)))
    if result is not None:
        assert result.target.startswith("/") and len(result.body) <= MAX_BODY_BYTES


@pytest.fixture(scope="module")
def health() -> Iterator[HealthServer]:
    with HealthServer(Metrics(), request_timeout=10) as server:
        yield server


def _send_then_read(s: socket.socket, data: bytes) -> bytes:
    """Send ``data`` and half-close, then everything the server answers until it closes."""
    with contextlib.suppress(OSError):  # the server may answer and close mid-send
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def _exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        return _send_then_read(s, data)


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES)
@given(st.data())
def test_health_port_answers_hostile_requests_with_4xx(
    health: HealthServer, data: st.DataObject
) -> None:
    """Over a real socket, arbitrary or mutated requests get a 4xx, a normal answer or
    a silent close, and the server keeps answering probes."""
    _, wire = data.draw(http_requests())
    payload = data.draw(st.sampled_from([wire, b"\r\n\r\n"]).flatmap(
        lambda w: mutated(w) | st.binary(max_size=200).map(lambda b: b + b"\r\n\r\n")))
    answer = _exchange(health.port, payload)
    if answer:
        status = int(answer.split(b" ", 2)[1])
        assert answer.startswith(b"HTTP/1.1 ") and status in (200, 400, 403, 404, 405, 413,
                                                              414, 431, 503), answer[:60]
    assert _exchange(health.port, b"GET /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 ")


# ----------------------------------------------------------------------- Redis URLs

_SCHEMES = ["redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster",
            "rediss+cluster", "unix", "http", "REDIS"]
hostnames = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?(\.[a-z0-9]{1,8}){0,2}", fullmatch=True)
ipv6 = st.ip_addresses(v=6).map(lambda a: f"[{a}]")


@settings(max_examples=400, deadline=None)
@given(
    st.text(max_size=80)
    | st.tuples(st.sampled_from(_SCHEMES),
                st.text("abc019:/@[],.%?#+ ²٣０\t\n", max_size=40)).map(lambda t: f"{t[0]}://{t[1]}")
)
def test_arbitrary_redis_urls_parse_or_raise_config_error(url: str) -> None:
    """Any text is a RedisTarget or a ConfigError that quotes the URL, never another error."""
    try:
        target = parse_redis_url(url)
    except ConfigError as e:
        assert "redis_url=" in str(e)
        return
    for host, port in target.hosts:
        assert host and 0 < port < 65536
    assert target.db >= 0


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["single", "sentinel", "cluster"]),
    tls=st.booleans(),
    hosts=st.lists(st.tuples(hostnames | ipv6, st.integers(1, 65535)), min_size=1, max_size=3),
    password=st.none() | st.text(min_size=1, max_size=20),
    db=st.integers(0, 15),
    service=st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
)
def test_valid_redis_urls_round_trip(
    kind: str, tls: bool, hosts: list[tuple[str, int]], password: str | None, db: int,
    service: str,
) -> None:
    """A URL built from hosts, ports, a password, a database and a service parses back
    to exactly those."""
    if kind == "single":
        hosts = hosts[:1]
    if kind == "cluster":
        db = 0
    scheme = ("rediss" if tls else "redis") + {"single": "", "sentinel": "+sentinel",
                                                "cluster": "+cluster"}[kind]
    auth = f":{urllib.parse.quote(password, safe='')}@" if password else ""
    path = f"/{service}/{db}" if kind == "sentinel" else f"/{db}"
    url = f"{scheme}://{auth}{','.join(f'{h}:{p}' for h, p in hosts)}{path}"
    expected = RedisTarget(kind, tls, tuple((h.strip("[]"), p) for h, p in hosts),  # type: ignore[arg-type]
                           None, password, db, service if kind == "sentinel" else None)
    assert parse_redis_url(url) == expected


# ------------------------------------------------------------- Settings and from_env

_FIELDS = [f.name for f in dataclasses.fields(Settings)]
_ENV = [ENV_PREFIX + n.upper() for n in _FIELDS] + [SECRET_FILE_ENV]
env_text = st.text(max_size=30) | st.sampled_from(
    ["0", "1", "-1", "nan", "inf", "1e400", "1_000", "٣", " 5 ", "true", "", "9" * 5000,
     "redis://h:1/0", "rediss://h:1/0", "gloo", "full", "\udc80", "a\x00b"]
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(_ENV), env_text, max_size=5))
def test_from_env_gives_settings_or_config_error_naming_the_variable(env: dict[str, str]) -> None:
    """Any environment gives valid Settings or a ConfigError that names a variable it set."""
    try:
        Settings.from_env(env)
    except ConfigError as e:
        assert any(name in str(e) for name in env), (str(e), sorted(env))


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=4))
def test_settings_from_json_values_give_settings_or_config_error(values: dict[str, Any]) -> None:
    """Any JSON value for any field (vLLM's extra config is JSON) gives valid Settings or
    a ConfigError naming one of the fields given, never another exception."""
    try:
        Settings(**values)
    except ConfigError as e:
        assert any(name in str(e) for name in values), (str(e), sorted(values))


# ------------------------------------------------------------------ hand-off protocol


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


@pytest.fixture(scope="module")
def handoff() -> Iterator[tuple[str, dict[str, Any]]]:
    """A real hand-off server, and the valid reply it gives a matching consumer."""
    directory = tempfile.mkdtemp(prefix="nbp")
    path = os.path.join(directory, "h.sock")
    with HandoffServer(_net(), "v1", path):
        request = {"protocol": PROTOCOL, "version": "v1",
                   "manifest_digest": manifest(_net()).digest, "mode": "copy"}
        reply = json.loads(_line_exchange(path, json.dumps(request).encode() + b"\n"))
        assert reply["ok"] is True
        yield path, reply
    shutil.rmtree(directory, ignore_errors=True)


def _line_exchange(path: str, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(path)
        return _send_then_read(s, data)


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURES)
@given(st.dictionaries(
    st.sampled_from(["protocol", "version", "manifest_digest", "mode", "x"]), json_values
) | json_values | st.binary(max_size=100))
def test_handoff_server_refuses_any_bad_request(
    handoff: tuple[str, dict[str, Any]], request_obj: Any
) -> None:
    """Any request (arbitrary JSON or bytes) gets a typed refusal or nothing, never a
    segment; the server keeps serving."""
    path, _ = handoff
    raw = request_obj if isinstance(request_obj, bytes) else json.dumps(request_obj).encode()
    answer = _line_exchange(path, raw.replace(b"\n", b" ") + b"\n")
    if answer:
        reply = json.loads(answer)
        assert reply["ok"] is False and reply["reason"] in ("protocol", "version", "manifest", "mode")
        assert "segment" not in reply


class _Hostile:
    """A Unix-socket 'sidecar' in this process that answers every request with the
    line it is given (what an attacker or a broken sidecar might send)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="nbx")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "x.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(4)
        self.line = b"{}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(10)
                conn.recv(1 << 16)
                conn.sendall(self.line + b"\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def hostile() -> Iterator[_Hostile]:
    h = _Hostile()
    yield h
    h.close()


@st.composite
def mutated_replies(draw: st.DrawFn, reply: dict[str, Any]) -> dict[str, Any]:
    """The valid reply with a few fields (or entries of its layout or hashes) replaced
    by arbitrary JSON or deleted."""
    out = json.loads(json.dumps(reply))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "top", "layout", "hashes"]))
        # An earlier round may have replaced layout or hashes by any JSON: mutate them
        # entry by entry only while they still have their own type.
        kind = list if where == "layout" else dict
        if where == "top" or not isinstance(out.get(where), kind) or not out[where]:
            key = draw(st.sampled_from(sorted(out) + ["size", "segment", "kind", "cuda"]))
            if draw(st.booleans()):
                out.pop(key, None)
            else:
                out[key] = draw(json_values | st.integers(-(1 << 70), 1 << 70))
        elif where == "layout":
            i = draw(st.integers(0, len(out["layout"]) - 1))
            out["layout"][i] = draw(json_values | st.tuples(st.text(max_size=5), st.integers()).map(list))
        else:
            key = draw(st.sampled_from(sorted(out["hashes"])))
            out["hashes"][key] = draw(json_values)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURES)
@given(st.data())
def test_attach_refuses_any_mutated_reply(
    handoff: tuple[str, dict[str, Any]], hostile: _Hostile, data: st.DataObject
) -> None:
    """A consumer given a mutated reply either loads exactly the right bytes or raises
    AttachError / WeightVerificationError, never another exception."""
    _, valid = handoff
    reply = data.draw(mutated_replies(valid))
    assume(reply != valid)
    hostile.line = json.dumps(reply).encode()
    model = build(_Net, "cpu")
    try:
        attach(model, hostile.path, version="v1", timeout=10)
    except (AttachError, WeightVerificationError):
        return
    reference = _net().state_dict()
    for name, t in model.state_dict().items():
        assert t.numpy().tobytes() == reference[name].numpy().tobytes(), name


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURES)
@given(json_values | st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"")))
def test_attach_refuses_any_arbitrary_reply(hostile: _Hostile, line: Any) -> None:
    """Arbitrary JSON or bytes as the sidecar's reply is an AttachError, never another
    exception."""
    hostile.line = line if isinstance(line, bytes) else json.dumps(line).encode()
    with pytest.raises(AttachError):
        attach(build(_Net, "cpu"), hostile.path, version="v1", timeout=10)
