"""Redis high availability on loopback: a Sentinel-managed master with a replica,
and a TLS terminator in front of any local Redis (``rediss://`` tests)."""

from __future__ import annotations

import selectors
import shutil
import socket
import ssl
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nccl_back.dev.servers import (
    LocalRedis,
    Started,
    _wait_until,
    free_port,
    redis_server_binary,
)


@dataclass
class LocalSentinel(Started):
    """A Sentinel-managed Redis on loopback: a master, one replica and three sentinels
    (quorum 2) that fail over a few seconds after the master stops answering.
    ``url`` is a ``redis+sentinel://`` URL naming the master ``service``."""

    service: str = "mymaster"
    password: str | None = None
    sentinel_password: str | None = None
    """The sentinels' own ``requirepass`` (``Settings.redis_sentinel_password``)."""
    down_after_ms: int = 5000
    """How long a server may not answer before the sentinels call it down. Not shorter: on
    a busy machine processes go unscheduled for a second or more, and at 1 s the sentinels
    failed over with nothing killed and never agreed for long."""
    servers: list[LocalRedis] = field(default_factory=list, init=False)
    sentinels: list[LocalRedis] = field(default_factory=list, init=False)
    _dir: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{auth}{hosts}/{self.service}/0"

    def _sentinel_client(self, s: LocalRedis) -> Any:
        import redis

        return redis.Redis(port=s.port, password=self.sentinel_password, decode_responses=True,
                           socket_timeout=2, socket_connect_timeout=2)

    def _agreed_master(self) -> int | None:
        """The master's port if every sentinel names the same one, sees it up (flags exactly
        ``master``: what redis-py's discovery accepts) and knows the other sentinels."""
        ports = set()
        for s in self.sentinels:
            with self._sentinel_client(s) as c:
                state = c.sentinel_master(self.service)
            if state["flags"] != "master" or state["num-other-sentinels"] != len(self.sentinels) - 1:
                return None
            ports.add(int(state["port"]))
        return ports.pop() if len(ports) == 1 else None

    def _answers_as_master(self, port: int) -> bool:
        import redis

        with redis.Redis(port=port, password=self.password, socket_timeout=2) as c:
            return bool(c.info("replication")["role"] == "master")

    def _client_finds(self, port: int) -> bool:
        """redis-py's own Sentinel discovery (what workers use) names ``port``."""
        from redis.sentinel import Sentinel

        sentinel = Sentinel([("127.0.0.1", s.port) for s in self.sentinels],
                            sentinel_kwargs={"password": self.sentinel_password, "socket_timeout": 2},
                            socket_timeout=2)
        try:
            return bool(sentinel.discover_master(self.service)[1] == port)
        finally:
            for c in sentinel.sentinels:
                c.close()

    def wait_ready(self, timeout: float = 60.0) -> int:
        """Wait until a failover could succeed: every sentinel names the same master, up,
        knows the other sentinels and the replica (up, its link to the master ``ok``), and
        the replica has synced. Returns the master's port."""

        def ready() -> int | None:
            port = self._agreed_master()
            if port is None or not self._answers_as_master(port):
                return None
            for s in self.sentinels:
                with self._sentinel_client(s) as c:
                    replicas = c.sentinel_slaves(self.service)
                if len(replicas) != len(self.servers) - 1 or any(
                    r["flags"] != "slave" or r["master-link-status"] != "ok" for r in replicas
                ):
                    return None
            import redis

            for server in self.servers:
                if server.port != port:
                    with redis.Redis(port=server.port, password=self.password, socket_timeout=2) as c:
                        if c.info("replication").get("master_link_status") != "up":
                            return None
            return port if self._client_finds(port) else None

        return _wait_until(ready, timeout,
                           "the sentinels did not agree on a master with a synced replica")

    def wait_failover(self, old_port: int, timeout: float = 90.0) -> int:
        """Wait until every sentinel names the same new master, up, that answers as master
        and that redis-py's discovery finds; returns its port."""

        def promoted() -> int | None:
            port = self._agreed_master()
            if port is None or port == old_port or not self._answers_as_master(port):
                return None
            return port if self._client_finds(port) else None

        return _wait_until(promoted, timeout, f"no failover away from port {old_port}")

    def start(self, timeout: float = 30.0) -> LocalSentinel:
        try:
            master = LocalRedis(password=self.password).start()
            self.servers.append(master)
            self.servers.append(LocalRedis(password=self.password, extra=[
                "--replicaof", "127.0.0.1", str(master.port)]).start())
            self._dir = tempfile.mkdtemp(prefix="nccl-back-sentinel-")
            for i in range(3):
                port = free_port()
                conf = Path(self._dir) / f"sentinel-{i}.conf"
                lines = [
                    f"port {port}", "bind 127.0.0.1", f"dir {self._dir}",
                    f"sentinel monitor {self.service} 127.0.0.1 {master.port} 2",
                    f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                    f"sentinel failover-timeout {self.service} 5000",
                    f"sentinel parallel-syncs {self.service} 1",
                ]
                if self.password:
                    lines.append(f"sentinel auth-pass {self.service} {self.password}")
                if self.sentinel_password:
                    # Sentinels authenticate to each other with sentinel-pass.
                    lines += [f"requirepass {self.sentinel_password}",
                              f"sentinel sentinel-pass {self.sentinel_password}"]
                conf.write_text("\n".join(lines) + "\n")  # sentinel rewrites its config file
                sentinel = LocalRedis(port=port)
                self.sentinels.append(sentinel)
                # `redis-server FILE --sentinel`: the config file comes first, so not start().
                sentinel._spawn([redis_server_binary(), str(conf), "--sentinel"],
                                "redis sentinel", 10)

            def ready() -> bool:
                for s in self.sentinels:
                    with self._sentinel_client(s) as c:
                        replicas = c.execute_command("SENTINEL REPLICAS", self.service)
                        others = c.execute_command("SENTINEL SENTINELS", self.service)
                        if len(replicas) != 1 or len(others) != 2:
                            return False
                return True

            # Failover needs each sentinel to know the replica and a majority of its peers.
            _wait_until(ready, timeout, "the sentinels did not discover the replica and each other")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in [*self.sentinels, *self.servers]:
            s.stop()
        self.sentinels.clear()
        self.servers.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


@dataclass
class TLSTerminator(Started):
    """A TLS front (as stunnel) on loopback forwarding plaintext to ``target_port``; with
    ``client_ca`` it requires a client certificate signed by it (mutual TLS)."""

    target_port: int
    certfile: str
    keyfile: str
    client_ca: str | None = None
    port: int = 0
    _sock: socket.socket | None = field(default=None, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False)

    def start(self) -> TLSTerminator:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.client_ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.client_ca)
        self._ctx = ctx
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._spawn(self._accept_loop)
        return self

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="tls-terminator")
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        listener = self._sock
        while listener is not None and not self._stop.is_set():
            try:
                raw, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            self._spawn(self._serve, raw)

    def _serve(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(5)
            conn = self._ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()  # a failed handshake (wrong CA, no client cert): the client sees it
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        conn.setblocking(False)
        upstream.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(conn, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, conn)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    src, dst = key.fileobj, key.data
                    try:
                        data = [src.recv(65536)]  # type: ignore[union-attr]
                    except (ssl.SSLWantReadError, BlockingIOError):
                        continue
                    if not data[0]:
                        return
                    # TLS may hold decrypted bytes the selector will not report.
                    while src is conn and conn.pending():
                        data.append(conn.recv(conn.pending()))
                    dst.setblocking(True)
                    dst.sendall(b"".join(data))
                    dst.setblocking(False)
        except (OSError, ssl.SSLError):
            return
        finally:
            sel.close()
            conn.close()
            upstream.close()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        for t in self._threads:
            t.join(2)
