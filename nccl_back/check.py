"""``nccl-back check``: will this worker be able to load from peers and serve them?

A preflight with the worker's own settings; each :class:`Check` is ok, failed (with the
problem and its fix) or skipped. Only :func:`check_transports` imports torch (slow, maybe
absent), so ``--skip transports`` answers without it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from nccl_back.config import ENV_PREFIX, SECRET_FILE_ENV, Settings
from nccl_back.errors import ConfigError, NcclBackError, RegistryError
from nccl_back.redis_url import parse_redis_url

Status = Literal["ok", "fail", "skip"]
SECRET_ENV = ENV_PREFIX + "SECRET"
#: Every check, in the order it runs; ``--skip`` takes these names.
NAMES = ("settings", "redis", "namespace", "secret", "advertise", "rendezvous", "health",
         "transports", "cache", "storage")


@dataclass(frozen=True)
class Check:
    """One answer: ``status`` ok/fail/skip, what was found or went wrong, and the fix."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        """``ok    name  detail`` or ``FAIL  name  problem; fix: ...`` (one line)."""
        tag = {"ok": "ok", "fail": "FAIL", "skip": "skip"}[self.status]
        text = f"{self.detail.rstrip('.')}; fix: {self.fix}" if self.fix else self.detail
        return f"{tag:<5} {self.name:<11} {' '.join(text.split())}"


@dataclass(frozen=True)
class Target:
    """What the worker will use besides :class:`Settings` (``serve``'s own flags)."""

    model_uri: str | None = None
    health_host: str = "127.0.0.1"
    health_port: int = 9400


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def fail(name: str, problem: str, fix: str) -> Check:
    return Check(name, "fail", problem, fix)


def skip(name: str, why: str) -> Check:
    return Check(name, "skip", why)


def load_settings(
    environ: Mapping[str, str], overrides: Mapping[str, Any]
) -> tuple[Check, Check, Settings | None]:
    """The ``settings`` and ``secret`` checks, and the Settings (None if unusable); the
    secret is judged apart, so a bad one fails its own line while the rest still run."""
    rest = {k: v for k, v in environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    try:
        settings = Settings.from_env(rest, **overrides)
    except ConfigError as e:
        settings = None
        settings_check = fail("settings", str(e), "correct that NCCL_BACK_* variable or flag")
    else:
        settings_check = ok("settings", "NCCL_BACK_* variables and flags are valid")
    secret_env = {k: v for k, v in environ.items() if k in (SECRET_ENV, SECRET_FILE_ENV)}
    try:
        secret = Settings.from_env(secret_env).secret
    except ConfigError as e:
        return settings_check, fail("secret", str(e), _SECRET_FIX), settings
    if secret is None:
        return settings_check, fail(
            "secret", f"no fleet secret ({SECRET_FILE_ENV} and {SECRET_ENV} unset):"
            " records are unsigned, anyone who can write to Redis can feed this worker weights",
            _SECRET_FIX), settings
    source = f"{SECRET_FILE_ENV}={secret_env[SECRET_FILE_ENV]}" if SECRET_FILE_ENV in secret_env \
        else SECRET_ENV
    detail = f"{len(secret.encode())} bytes from {source}"
    if settings is not None:
        settings = settings.replace(secret=secret)
        # A digest of a derived key, never the secret: equal on every worker of a fleet.
        key_id = (settings.key("check") or b"").hex()[:8]
        detail += f", key id {key_id} (the same on every worker)"
    return settings_check, ok("secret", detail), settings


_SECRET_FIX = (f"put the fleet's shared secret (at least 16 bytes, e.g. `openssl rand -hex 32`)"
               f" in a file and set {SECRET_FILE_ENV} to it, the same on every worker")


def _redis_fix(error: BaseException) -> str:
    """The fix for a failed connection, from the redis-py error it wraps."""
    import redis

    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(c, redis.AuthenticationError) for c in chain) or any(
        "NOAUTH" in str(c) or "WRONGPASS" in str(c) for c in chain
    ):
        return ("put the Redis password in NCCL_BACK_REDIS_URL (redis://:PASSWORD@host:port/db,"
                " URL-encoded) as the server's requirepass has it")
    if "TLS certificate verification failed" in str(error):
        return ("put ?ssl_ca_certs=PATH in NCCL_BACK_REDIS_URL: the CA bundle that signed"
                " the server's certificate, and use the host name the certificate names")
    if "sentinel" in str(error):
        return ("check the sentinel addresses and the service name in NCCL_BACK_REDIS_URL,"
                " and its ?sentinel_password=")
    return ("start Redis or correct host and port in NCCL_BACK_REDIS_URL; from a pod, check"
            " the Service name and that a NetworkPolicy admits this pod to it")


def check_redis(settings: Settings) -> tuple[Check, Any]:
    """PING the coordination store; returns the check and the Registry (None on failure)."""
    from nccl_back.coord.registry import Registry
    from nccl_back.redis_url import redact  # the one redaction of Redis URLs

    target = parse_redis_url(settings.redis_url)
    where = redact(settings.redis_url)
    try:
        registry = Registry(settings)
        t = time.perf_counter()
        registry.ping()
        ms = (time.perf_counter() - t) * 1e3
    except RegistryError as e:
        return fail("redis", str(e), _redis_fix(e)), None
    except ConfigError as e:  # a TLS file that does not exist
        return fail("redis", str(e), "point it at an existing PEM file"), None
    tls = ", TLS certificate and host name verified" if target.tls else ", no TLS"
    return ok("redis", f"{where} ({target.kind}{tls}): PING {ms:.1f} ms"), registry


def check_namespace(settings: Settings, registry: Any) -> Check:
    """Write, read back and delete a probe key in the namespace; count what it holds."""
    from nccl_back.coord import schema

    key = registry.keys.of(schema.CHECK, uuid.uuid4().hex)
    try:
        registry.client.set(key, "1", px=10_000)
        back = registry.raw_value(key, schema.CHECK)  # bounded, as every read
        registry.client.delete(key)
        listing = registry.list_all()
    except Exception as e:  # redis-py errors, ACL refusals (NOPERM) among them
        return fail("namespace", f"namespace {settings.namespace!r}: cannot write and read a"
                    f" key ({e})", "grant this Redis user read/write on the namespace's keys"
                    f" ({'{' + settings.namespace + '}'}:*)")
    if back != b"1":
        return fail("namespace", f"namespace {settings.namespace!r}: a key written did not read"
                    " back", "use a Redis primary, not a read-only replica")
    peers = sum(len(p) for p in listing.values())
    if registry.rejected:
        # This worker would skip those peers: most often a fleet with two secrets.
        return fail("namespace", f"namespace {settings.namespace!r}: {registry.rejected} peer"
                    f" record(s) rejected (signed with another secret, unsigned, or malformed);"
                    f" {peers} usable", "give every worker of the fleet the same secret (the key"
                    " id on the secret line must match theirs), or use another namespace")
    return ok("namespace", f"{settings.namespace!r} writable; {len(listing)} version(s),"
                           f" {peers} peer(s) published")


def _addresses(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(i[4][0]) for i in infos})


def check_advertise(settings: Settings) -> Check:
    """The advertised address resolves to an address of this host (one it can bind)."""
    host = settings.advertise_host
    fix = ("set NCCL_BACK_ADVERTISE_HOST (--advertise-host) to this worker's own address"
           " (in Kubernetes the pod IP, from the downward API: status.podIP)")
    try:
        addresses = _addresses(host)
    except OSError as e:
        return fail("advertise", f"advertise_host {host!r} does not resolve ({e})", fix)
    for addr in addresses:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, 0))
            except OSError as e:
                return fail("advertise", f"advertise_host {host!r} ({addr}) is not an address of"
                            f" this host ({e.strerror})", fix)
    loopback = all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    own = ""
    try:
        name = socket.gethostname()
        if set(addresses) & set(_addresses(name)):
            own = f", the address of this host's name {name!r}"
    except OSError:
        pass
    note = " (loopback: peers on other hosts cannot reach it)" if loopback else ""
    return ok("advertise", f"{host} ({', '.join(addresses)}) is on this host{own}{note}")


def _listen_and_connect(bind: str, port: int, reach: str, timeout: float) -> tuple[int, str]:
    """Listen on ``bind:port`` and connect to it at ``reach``; the port and '' or the problem."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as srv:
        # As a real server would: a port with only TIME_WAIT connections is free.
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((bind, port))
        except OSError as e:
            why = "in use by another process" if e.errno == errno.EADDRINUSE else e.strerror
            return port, f"cannot listen on {bind}:{port} ({why})"
        srv.listen(1)
        bound = int(srv.getsockname()[1])
        try:
            with socket.create_connection((reach, bound), timeout=timeout):
                pass
        except OSError as e:
            return bound, f"listening on {bind}:{bound}, but {reach}:{bound} is unreachable ({e})"
    return bound, ""


def check_rendezvous(settings: Settings) -> Check:
    """An ephemeral transport port listens on the advertised address and is reached there
    (the rendezvous is in Redis; gloo's data socket takes an ephemeral port per transfer)."""
    host = settings.advertise_host
    bound, problem = _listen_and_connect(host, 0, host, settings.redis_timeout)
    if problem:
        return fail("rendezvous", f"ephemeral transport port: {problem}",
                    "set NCCL_BACK_ADVERTISE_HOST (--advertise-host) to this worker's own"
                    " address, one its transports can listen on and peers can reach")
    return ok("rendezvous", f"ephemeral transport port (probed {bound}) listens on {host}"
                            f" and is reached there (the rendezvous itself is in Redis)")


def check_health(target: Target, settings: Settings) -> Check:
    """The health port (probes and /metrics) can be bound and reached."""
    reach = "127.0.0.1" if target.health_host in ("0.0.0.0", "") else target.health_host
    reach = "::1" if target.health_host == "::" else reach
    bound, problem = _listen_and_connect(target.health_host, target.health_port, reach,
                                         settings.redis_timeout)
    if problem:
        return fail("health", f"health port: {problem}",
                    "stop what holds it or pass --health-port with a free port (and the same"
                    " port in the probes and the preStop hook)")
    return ok("health", f"{target.health_host}:{bound} listens (/healthz /readyz /metrics)")


def check_transports(settings: Settings) -> Check:
    """Each registered transport kind's probe (gloo in this torch; with CUDA, NCCL's
    version and the visible GPUs), in registry order; the first problem fails (imports
    torch)."""
    try:
        import torch
    except ImportError as e:
        return fail("transports", f"torch is not importable ({e})",
                    "install torch (a CUDA build on GPU nodes)")
    from nccl_back.transport.channel import all_transports

    found = []
    for classes in all_transports().values():
        probe = classes.probe(settings)
        if probe.problem:
            return fail("transports", probe.problem, probe.fix)
        if probe.found:
            found.append(probe.found)
    return ok("transports", f"torch {torch.__version__}: {', '.join(found)}")


def check_cache(settings: Settings) -> Check:
    """The CRC32C cache directory exists (or can be made) and takes a file."""
    d = settings.cache_dir
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".nccl-back-check-"):
            pass
    except OSError as e:
        return fail("cache", f"cache_dir {d!r}: not writable ({e.strerror or e})",
                    "set NCCL_BACK_CACHE_DIR (--cache-dir) to a writable directory"
                    " (an emptyDir in Kubernetes)")
    return ok("cache", f"{d} writable")


def check_storage(target: Target, settings: Settings) -> Check:
    """The checkpoint's spec (version, shards) and the first bytes of one shard read,
    through the backend of the model URI's scheme (which endpoint, as whom)."""
    if not target.model_uri:
        return skip("storage", "no --model given")
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.storage import Storage, forms, parse_uri

    uri = target.model_uri
    try:
        storage = Storage(settings)
        spec = ModelSpec.from_dir(uri, storage=storage, settings=settings)
        if spec.shards:
            storage.read_range(spec.shards[0].uri, 0, 8)
        where = storage.backend(parse_uri(uri)).describe()
    except NcclBackError as e:
        return fail("storage", f"--model {uri!r}: {e}",
                    f"give the checkpoint (config.json and *.safetensors) as {forms()},"
                    " with credentials that may read it")
    size = sum(s.size for s in spec.shards)
    via = f" ({where})" if where else ""
    return ok("storage", f"{uri}{via}: version {spec.version}, {len(spec.shards)} shard(s),"
                         f" {size} bytes")


def run_checks(
    environ: Mapping[str, str], overrides: Mapping[str, Any], target: Target,
    skip_names: frozenset[str] = frozenset(),
) -> list[Check]:
    """Every check in :data:`NAMES` order; those in ``skip_names``, or that need a failed
    one's result (Settings, a Redis connection), are reported as skipped."""
    unknown = skip_names - set(NAMES)
    if unknown:
        raise ConfigError(f"--skip {','.join(sorted(unknown))}: no such check; choose from"
                          f" {', '.join(NAMES)}")
    settings_check, secret_check, settings = load_settings(environ, overrides)
    results = {"settings": settings_check, "secret": secret_check}
    registry: Any = None
    if settings is not None:
        s = settings
        steps: dict[str, Callable[[], Check]] = {
            "advertise": lambda: check_advertise(s),
            "rendezvous": lambda: check_rendezvous(s),
            "health": lambda: check_health(target, s),
            "transports": lambda: check_transports(s),
            "cache": lambda: check_cache(s),
            "storage": lambda: check_storage(target, s),
        }
        if "redis" not in skip_names:
            results["redis"], registry = check_redis(s)
        if registry is not None and "namespace" not in skip_names:
            results["namespace"] = check_namespace(s, registry)
        for name, step in steps.items():
            if name not in skip_names:
                results[name] = step()
    if registry is not None:
        registry.close()
    out = []
    for name in NAMES:
        if name in skip_names:
            out.append(skip(name, "--skip"))
        elif name in results:
            out.append(results[name])
        else:
            needs = "valid settings" if settings is None else "a reachable Redis"
            out.append(skip(name, f"needs {needs}"))
    return out


def failed(checks: list[Check]) -> bool:
    """Whether any check failed (a check skipped for another's failure implies one)."""
    return any(c.status == "fail" for c in checks)


def as_json(checks: list[Check]) -> dict[str, Any]:
    return {"ok": not failed(checks), "checks": [asdict(c) for c in checks]}
