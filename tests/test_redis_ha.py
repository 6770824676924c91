"""Highly available Redis: a real 3-master Redis Cluster, a real Sentinel set (master,
replica, three sentinels) with a failover during a load, and TLS with verification on
(a real TLS endpoint on loopback: the redis-server the tests use has no TLS built in, so
a TLS terminator fronts it, as stunnel or a cloud endpoint would)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from stored import stored_json

from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.election import DownloadLease
from nccl_back.coord.records import TransferRequest
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.dev.redis_ha import LocalSentinel, TLSTerminator
from nccl_back.dev.servers import LocalRedis, LocalRedisCluster
from nccl_back.errors import ConfigError, RegistryError
from nccl_back.model.scheme import SCHEME
from nccl_back.redis_url import parse_redis_url

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(120)

APP = Path(__file__).resolve().parent / "embed_app.py"
EXE = str(Path(sys.executable).parent / "nccl-back")


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(masters=3, password="pw") as c:
        yield c


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)


def _app(ckpt: Path, url: str, namespace: str, cache_dir: str, result: Path, *extra: str,
         env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(APP), str(ckpt), url, namespace, cache_dir, str(result), *extra],
        cwd=APP.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )


def _wait_file(path: Path, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared: {proc.communicate()[1][-3000:]}")
        time.sleep(0.02)


def _peer_load(ckpt: Path, url: str, namespace: str, cache_dir: str, tmp: Path,
               env: dict[str, str] | None = None) -> dict[str, object]:
    """A storage-loaded sender process, then a receiver process; the receiver's result."""
    stop = tmp / "stop"
    sender = _app(ckpt, url, namespace, cache_dir, tmp / "a.json", "--serve-until", str(stop), env=env)
    try:
        _wait_file(tmp / "a.json", sender)
        receiver = _app(ckpt, url, namespace, cache_dir, tmp / "b.json", env=env)
        _, err = receiver.communicate(timeout=90)
        assert receiver.returncode == 0, err[-3000:]
    finally:
        stop.touch()
        sender.communicate(timeout=30)
    return dict(json.loads((tmp / "b.json").read_text()))


def _info(peer_id: str, version: str = "v1") -> PeerInfo:
    return PeerInfo(peer_id, version, 0, 1, "d" * 32, "gloo", "127.0.0.1:1")


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("url", "kind", "tls", "hosts", "service", "db"),
    [
        ("redis://:pw@h:6380/2", "single", False, (("h", 6380),), None, 2),
        ("rediss://h", "single", True, (("h", 6379),), None, 0),
        ("redis+sentinel://:pw@s1,s2:26380/mymaster/1", "sentinel", False,
         (("s1", 26379), ("s2", 26380)), "mymaster", 1),
        ("rediss+cluster://a:7000,[::1]:7001", "cluster", True, (("a", 7000), ("::1", 7001)), None, 0),
    ],
)
def test_urls_parse(url: str, kind: str, tls: bool, hosts: tuple[tuple[str, int], ...],
                    service: str | None, db: int) -> None:
    """Single, Sentinel and Cluster URLs (plain and TLS) parse into hosts, service and db."""
    t = parse_redis_url(url)
    assert (t.kind, t.tls, t.hosts, t.service, t.db) == (kind, tls, hosts, service, db)
    Settings(redis_url=url)  # accepted by the settings too


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"redis_url": "redis+sentinel://s1:26379"}, r"name the master"),
        ({"redis_url": "redis+cluster://a:7000/3"}, r"a Redis Cluster has only database 0"),
        ({"redis_url": "redis://a:1,b:2/0"}, r"several hosts; use redis\+sentinel:// or redis\+cluster://"),
        ({"redis_url": "redis+cluster://a:99999"}, r"bad port"),
        ({"redis_url": "redis://h?ssl_ca_certs=/ca.pem"}, r"ssl_ca_certs given but the URL is not TLS"),
        ({"redis_url": "rediss://h?ssl_keyfile=/k.pem"}, r"ssl_keyfile given without ssl_certfile"),
        ({"redis_url": "rediss://h?ssl_ca_certs=/a.pem&ssl_ca_certs=/b.pem"}, r"ssl_ca_certs given twice or empty"),
        ({"redis_url": "redis://:pw@h?sentinel_password=sp"},
         r"^redis_url='redis://:\*\*\*@h\?sentinel_password=\*\*\*': sentinel_password is for redis\+sentinel://"),
    ],
)
def test_bad_ha_settings_are_config_errors(changes: dict[str, str], message: str) -> None:
    """A malformed Sentinel/Cluster URL, a TLS file without TLS or a sentinel password without
    Sentinel is a ConfigError naming it (passwords redacted)."""
    with pytest.raises(ConfigError, match=message):
        Settings(**changes)


# --------------------------------------------------------------------------- Redis Cluster


def test_cluster_every_registry_operation(cluster: LocalRedisCluster, namespace: str) -> None:
    """On a 3-master cluster every registry operation (transactions, MGET, Lua) works and
    every key of a namespace sits in one hash slot."""
    reg = Registry(Settings(redis_url=cluster.url, namespace=namespace))
    reg.publish_peer(_info("p1"))
    reg.publish_peer(_info("p2"))
    assert {p.peer_id for p in reg.find_peers("v1", 0, 1)} == {"p1", "p2"}
    token = reg.claim("p1", "r1", max_sends=1, ttl=5)
    assert token is not None and reg.claim("p1", "r2", max_sends=1, ttl=5) is None
    assert reg.active_claims("p1") == 1
    assert reg.renew_claim("p1", token, ttl=5)  # Lua scripts from here on
    reg.release("p1", token)
    assert reg.active_claims("p1") == 0
    hs = reg.keys.of(schema.HANDSHAKE, "t", "receiver_ready")
    reg.set_json(hs, {"value": 1}, ttl=5)
    assert reg.compare_and_set(hs, {"value": 1}, {"value": 2}, ttl=5)
    reg.delete(hs)
    assert stored_json(reg, hs) is None
    assert reg.put_ground_truth("v1", 0, 1, "d" * 32, SCHEME, {"layer": "h"})
    assert reg.get_ground_truth("v1", 0, 1, "d" * 32, SCHEME) == {"layer": "h"}
    req = {"transfer_id": "t", "receiver": "w", "version": "v1", "manifest_digest": "d" * 32,
           "transport": "gloo"}
    reg.push_request("p1", req)
    assert reg.pop_request("p1", 1.0) == TransferRequest(**req)
    reg.heartbeat(_info("p1"), SCHEME)
    assert list(reg.list_all()) == ["v1"]
    keys = list(reg.scan("*"))
    assert len(keys) == 4  # ground truth, two peer entries, their index
    slots = {reg.client.keyslot(k) for k in keys}
    assert slots == {reg.client.keyslot(reg.keys.key("x"))}
    reg.withdraw("p1", "v1")
    assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["p2"]
    # The other bounded reads: a batch of tombstones, a chain's items, a group's list.
    reg.mark_gone("m1", ttl=5)
    assert reg.gone_members(["m1", "m2"]) == {"m1"}
    member = {"member_id": "m1", "address": "127.0.0.1:1", "transport": "gloo", "device": "cpu"}
    chain, _ = reg.join_cohort("v1", 0, 1, "d" * 32, member, window=5, max_size=4, ttl=5)
    assert [m.member_id for m in reg.chain_members(chain, 0, 0) if m is not None] == ["m1"]
    reg.join_download_group("v1", 1, "w1")
    assert reg.download_group("v1", 1) == ["w1"]
    reg.close()


def test_cluster_download_lease_scripts(cluster: LocalRedisCluster, namespace: str) -> None:
    """The single-flight lease (SET NX, Lua renew and release) works on the cluster."""
    reg = Registry(Settings(redis_url=cluster.url, namespace=namespace))
    a = DownloadLease(reg, "v1", 1, "a", ttl=0.6)
    b = DownloadLease(reg, "v1", 1, "b", ttl=0.6)
    assert a.try_acquire() and not b.try_acquire()
    time.sleep(1.0)  # renewed by a's thread past its TTL
    assert a.holder() == "a"
    a.release()
    assert a.holder() is None and b.try_acquire()
    b.release()
    reg.close()


def test_cluster_peer_load(cluster: LocalRedisCluster, namespace: str, ckpt: Path,
                           cache_dir: str, tmp_path: Path) -> None:
    """Two worker processes coordinate through the cluster: the second loads from the first, verified."""
    result = _peer_load(ckpt, cluster.url, namespace, cache_dir, tmp_path)
    assert result["source"] == "peer" and result["verified"] is True


def test_cluster_status_command(cluster: LocalRedisCluster, namespace: str) -> None:
    """`nccl-back status` lists what a cluster holds."""
    reg = Registry(Settings(redis_url=cluster.url, namespace=namespace))
    reg.publish_peer(_info("p1"))
    proc = subprocess.run([EXE, "status", "--json", "--redis-url", cluster.url,
                           "--namespace", namespace], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [p["peer_id"] for p in json.loads(proc.stdout)["versions"]["v1"]["peers"]] == ["p1"]


# --------------------------------------------------------------------------- Sentinel


@pytest.mark.timeout(300)
def test_sentinel_failover_during_a_load(namespace: str, ckpt: Path, cache_dir: str,
                                         tmp_path: Path) -> None:
    """The master dies as a receiver starts loading: the load ends verified (from the peer
    or from storage with a reason), and after the failover the fleet works on the new master."""
    with LocalSentinel(password="pw") as sentinel:
        url = sentinel.url
        stop = tmp_path / "stop"
        sender = _app(ckpt, url, namespace, cache_dir, tmp_path / "a.json",
                      "--serve-until", str(stop))
        try:
            _wait_file(tmp_path / "a.json", sender)
            # Wait for what a failover needs, not for time: every sentinel agrees on the
            # master and sees the replica up and synced (a kill before that left the
            # sentinels with no good replica to promote: "no sentinel named a master").
            old_port = sentinel.wait_ready()
            old = next(s for s in sentinel.servers if s.port == old_port)
            started = tmp_path / "started"
            receiver = _app(ckpt, url, namespace, cache_dir, tmp_path / "b.json",
                            "--started", str(started))
            _wait_file(started, receiver)
            old.kill()  # SIGKILL: the master vanishes mid-load
            _, err = receiver.communicate(timeout=150)
            assert receiver.returncode == 0, err[-3000:]
            result = json.loads((tmp_path / "b.json").read_text())
            assert result["verified"] is True
            assert result["source"] == "peer" or result["fallback_reason"], result
            # The sentinels promoted the replica, all of them name it, and redis-py's own
            # discovery (what every worker uses) finds it ...
            assert sentinel.wait_failover(old_port) != old_port
            # ... and the sender's heartbeat keeps it published there: a new worker finds it.
            reg = Registry(Settings(redis_url=url, namespace=namespace))
            deadline = time.monotonic() + 60
            while not reg.find_peers(*_version_rank(ckpt, cache_dir)):
                assert time.monotonic() < deadline, "the sender never reappeared after failover"
                time.sleep(0.2)
            reg.close()
            third = _app(ckpt, url, namespace, cache_dir, tmp_path / "c.json")
            _, err = third.communicate(timeout=120)
            assert third.returncode == 0, err[-3000:]
            after = json.loads((tmp_path / "c.json").read_text())
            # A claim the receiver could not release when the master died keeps the sender
            # busy until the claim's TTL: the new worker may fall back, with that reason.
            assert after["verified"] is True
            assert after["source"] == "peer" or after["fallback_reason"], after
        finally:
            stop.touch()
            sender.communicate(timeout=30)


def test_sentinel_with_its_own_password(namespace: str) -> None:
    """Sentinels with their own password are reached with the URL's ?sentinel_password=; without it, a RegistryError."""
    with LocalSentinel(password="data-pw", sentinel_password="sentinel-pw") as sentinel:
        with pytest.raises(RegistryError, match="redis PING failed"):
            Registry(Settings(redis_url=sentinel.url, namespace=namespace, redis_timeout=0.5)).ping()
        reg = Registry(Settings(redis_url=sentinel.url + "?sentinel_password=sentinel-pw", namespace=namespace))
        reg.publish_peer(_info("p1"))
        assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["p1"]
        reg.close()


def test_unreachable_cluster_or_sentinel_is_one_registry_error(namespace: str) -> None:
    """No cluster seed answering, or no sentinel naming the master: a short RegistryError."""
    with pytest.raises(RegistryError, match=r"cannot reach redis \(redis\+cluster://.*cannot be connected"):
        Registry(Settings(redis_url="redis+cluster://127.0.0.1:1", namespace=namespace))
    reg = Registry(Settings(redis_url="redis+sentinel://127.0.0.1:1/mymaster", namespace=namespace,
                            redis_timeout=0.2))
    with pytest.raises(RegistryError, match=r"no sentinel named a master 'mymaster'") as info:
        reg.ping()
    assert len(str(info.value)) < 300


def _version_rank(ckpt: Path, cache_dir: str) -> tuple[str, int, int]:
    from nccl_back.model.identity import ModelSpec

    return ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir).version, 0, 1


# --------------------------------------------------------------------------- TLS


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
          usage: x509.ObjectIdentifier | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                       critical=False)
    )
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([usage or ExtendedKeyUsageOID.SERVER_AUTH]),
                            critical=False)
        if usage is None:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 it signed, a client certificate, and an unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key, server_key, client_key = _key(), _key(), _key(), _key()
    ca = _cert("test CA", ca_key, None, ca_key, ca=True)
    other = _cert("other CA", other_key, None, other_key, ca=True)
    server = _cert("redis", server_key, ca, ca_key)
    client = _cert("worker", client_key, ca, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return {
        "ca": _write(d / "ca.pem", ca), "other_ca": _write(d / "other.pem", other),
        "server": _write(d / "server.pem", server, server_key), "server_key": str(d / "server.key"),
        "client": _write(d / "client.pem", client, client_key), "client_key": str(d / "client.key"),
    }


@pytest.fixture
def tls_redis(redis_server: LocalRedis, pki: dict[str, str]) -> Iterator[TLSTerminator]:
    with TLSTerminator(redis_server.port, pki["server"], pki["server_key"]) as t:
        yield t


def test_tls_with_ca_bundle(tls_redis: TLSTerminator, pki: dict[str, str], namespace: str) -> None:
    """rediss:// with the CA bundle that signed the server: verified, every operation works."""
    reg = Registry(Settings(redis_url=f"rediss://127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={pki['ca']}",
                            namespace=namespace))
    reg.ping()
    reg.publish_peer(_info("p1"))
    assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["p1"]
    reg.close()


def test_tls_wrong_ca_is_one_clear_error(tls_redis: TLSTerminator, pki: dict[str, str],
                                         namespace: str) -> None:
    """A CA that did not sign the server's certificate: one RegistryError saying so and naming the fix."""
    url = f"rediss://127.0.0.1:{tls_redis.port}/0"
    wrong = f"{url}?ssl_ca_certs={pki['other_ca']}"
    reg = Registry(Settings(redis_url=wrong, namespace=namespace))
    with pytest.raises(RegistryError, match=r"TLS certificate verification failed .*put \?ssl_ca_certs=PATH in redis_url"):
        reg.ping()
    proc = subprocess.run([EXE, "status"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "NCCL_BACK_REDIS_URL": wrong})
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "TLS certificate verification failed" in proc.stderr
    # Without any CA the system store does not know our test CA either: verification is on.
    with pytest.raises(RegistryError, match="TLS certificate verification failed"):
        Registry(Settings(redis_url=url, namespace=namespace)).ping()


def test_tls_client_certificate(redis_server: LocalRedis, pki: dict[str, str], namespace: str) -> None:
    """An endpoint that demands a client certificate admits the worker only with its cert and key."""
    with TLSTerminator(redis_server.port, pki["server"], pki["server_key"], client_ca=pki["ca"]) as t:
        url = f"rediss://127.0.0.1:{t.port}/0"
        with pytest.raises(RegistryError, match="redis PING failed"):
            Registry(Settings(redis_url=f"{url}?ssl_ca_certs={pki['ca']}", namespace=namespace)).ping()
        mutual = f"{url}?ssl_ca_certs={pki['ca']}&ssl_certfile={pki['client']}&ssl_keyfile={pki['client_key']}"
        reg = Registry(Settings(redis_url=mutual, namespace=namespace))
        reg.ping()
        reg.close()


def test_tls_missing_ca_file_is_a_config_error(namespace: str) -> None:
    """A CA path that does not exist is named before any connection."""
    with pytest.raises(ConfigError, match=r"redis_url's ssl_ca_certs='/no/ca.pem': no such file"):
        Registry(Settings(redis_url="rediss://127.0.0.1:1/0?ssl_ca_certs=/no/ca.pem", namespace=namespace))


def test_tls_peer_load(tls_redis: TLSTerminator, pki: dict[str, str], namespace: str, ckpt: Path,
                       cache_dir: str, tmp_path: Path) -> None:
    """Two worker processes coordinate over TLS (the CA in the URL's ?ssl_ca_certs=): a verified peer load."""
    result = _peer_load(ckpt, f"rediss://127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={pki['ca']}", namespace,
                        cache_dir, tmp_path)
    assert result["source"] == "peer" and result["verified"] is True
