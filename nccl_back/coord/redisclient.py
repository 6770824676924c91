"""The coordination store's client: one Redis, a Sentinel-managed one, or a Redis Cluster,
plain or over TLS, chosen by ``Settings.redis_url`` (the URL forms: docs/redis.md). TLS
always verifies the server's certificate and host name.

The URL is parsed by :mod:`nccl_back.redis_url`; ``redis`` is imported here only when a
client is made, so the metadata CLI commands stay fast.
"""

from __future__ import annotations

import os
import ssl
from typing import Any

from nccl_back.config import Settings
from nccl_back.errors import ConfigError
from nccl_back.redis_url import RedisTarget, parse_redis_url, without_options


def _tls_kwargs(target: RedisTarget) -> dict[str, Any]:
    files = {"ssl_ca_certs": target.ca_file, "ssl_certfile": target.cert_file, "ssl_keyfile": target.key_file}
    for name, path in files.items():
        if path and not os.path.isfile(path):
            raise ConfigError(f"redis_url's {name}={path!r}: no such file")
    return {"ssl": True, "ssl_cert_reqs": "required", "ssl_check_hostname": True, **files}


def connect(settings: Settings) -> Any:
    """A redis-py client for ``settings.redis_url`` answering ``bytes``, every call bounded
    by ``settings.redis_timeout``. Raises :class:`ConfigError` for a bad URL or TLS file;
    a cluster is contacted here, so an unreachable one raises redis-py's error."""
    import redis

    target = parse_redis_url(settings.redis_url)
    common: dict[str, Any] = {
        "socket_timeout": settings.redis_timeout,
        "socket_connect_timeout": settings.redis_timeout,
        "decode_responses": False,  # replies are bytes: parsed by each kind's parser
    }
    tls = _tls_kwargs(target) if target.tls else {}
    if target.kind == "single":
        if target.tls:
            tls.pop("ssl")  # implied by rediss://
        try:
            return redis.Redis.from_url(without_options(settings.redis_url), health_check_interval=30,
                                        **common, **tls)
        except ValueError as e:
            raise ConfigError(f"cannot use redis_url: {e}") from e
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.kind == "sentinel":
        from redis.sentinel import Sentinel

        sentinel_kwargs = {
            **common, **tls, "password": target.sentinel_password,
        }
        sentinel = Sentinel(
            list(target.hosts), sentinel_kwargs=sentinel_kwargs,
            db=target.db, health_check_interval=30, **common, **tls, **auth,
        )
        return sentinel.master_for(target.service or "", redis_class=redis.Redis)
    from redis.cluster import ClusterNode, RedisCluster

    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], **common, **tls, **auth,
    )


def decodes_responses(client: Any) -> bool:
    """Whether a redis-py client (``Redis`` or ``RedisCluster``) decodes answers to str."""
    kwargs = (
        client.get_connection_kwargs()
        if hasattr(client, "get_connection_kwargs")
        else client.connection_pool.connection_kwargs
    )
    return bool(kwargs.get("decode_responses"))


def explain(error: BaseException) -> str:
    """A redis-py error as one line, with the fix for the common TLS and Sentinel mistakes."""
    from redis.sentinel import MasterNotFoundError

    text = str(error)
    if isinstance(error, MasterNotFoundError):
        # redis-py appends the repr of every sentinel connection: one line is enough.
        name = text.split(" : ", 1)[0].removeprefix("No master found for ")
        return (f"no sentinel named a master {name} (sentinels unreachable, the service name"
                " wrong, or the URL's ?sentinel_password= missing)")
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        return (f"TLS certificate verification failed ({text}); put ?ssl_ca_certs=PATH in redis_url"
                " (NCCL_BACK_REDIS_URL): the CA bundle that signed the Redis server's certificate")
    return text
