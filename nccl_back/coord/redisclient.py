"""The coordination store's client: one Redis, a Sentinel-managed one, or a Redis Cluster,
plain or over TLS, chosen by ``Settings.redis_url``.

- ``redis://[:password@]host:6379/0``: one server (``unix:///path/redis.sock?db=0`` too);
- ``redis+sentinel://[:password@]h1:26379,h2:26379/mymaster/0``: the master the
  sentinels name ``mymaster``, followed across failovers;
- ``redis+cluster://[:password@]h1:6379,h2:6379``: a Redis Cluster (any nodes, as seeds);
- ``rediss://``, ``rediss+sentinel://``, ``rediss+cluster://``: the same over TLS.

The URL's password is the data nodes' (``requirepass``); sentinels with their own
password take the URL's ``?sentinel_password=``. TLS always verifies the server's
certificate and host name, against the URL's ``?ssl_ca_certs=`` (or the system's CAs),
and presents ``?ssl_certfile=`` / ``?ssl_keyfile=`` when given (mutual TLS).

On a cluster every key of one namespace shares one hash slot (:class:`~.keys.Keys` puts
the namespace in a ``{hash tag}``), so multi-key commands, transactions and Lua scripts
work as on one server. The URL is parsed by :mod:`nccl_back.redis_url` (no ``redis``
import there: :class:`Settings` validates URLs with it and the metadata CLI commands
stay fast); ``redis`` is imported here only when a client is made.
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
    """A redis-py client for ``settings.redis_url`` (``Redis``, Sentinel-managed ``Redis``
    or ``RedisCluster``), answers as ``bytes`` (decoded by each record kind's parser,
    never by redis-py), every call bounded by
    ``settings.redis_timeout``. Raises :class:`ConfigError` for a bad URL or TLS file;
    a cluster is contacted here (redis-py discovers its slots on construction), so an
    unreachable one raises redis-py's error, which :class:`Registry` maps."""
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
