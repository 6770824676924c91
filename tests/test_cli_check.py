"""``nccl-back check``: a healthy set-up answers ok on every line and exits 0; each broken
one exits 1 with a FAIL line naming the problem and its fix. Every case is a real
subprocess against a real redis-server (plain, with a password, behind TLS), the GCS
emulator or a local directory, and real sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_redis_ha import _info, pki  # noqa: F401  (pki: a CA, a server certificate, another CA)

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.redis_ha import LocalSentinel, TLSTerminator
from nccl_back.dev.servers import LocalRedis, LocalRedisCluster, free_port

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(120)

SECRET = "s" * 32
NO_TORCH = ["--skip", "transports"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 2), tmp_path_factory.mktemp("c") / "ckpt",
                            n_shards=2)


@pytest.fixture(scope="module")
def redis_pw() -> Iterator[LocalRedis]:
    with LocalRedis(password="right-pw") as r:
        yield r


@pytest.fixture
def env(redis_url: str, namespace: str, tmp_path: Path) -> dict[str, str]:
    """A healthy worker's environment: Redis, namespace, secret file, cache directory."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}
    return {
        **base,
        "NCCL_BACK_REDIS_URL": redis_url,
        "NCCL_BACK_NAMESPACE": namespace,
        "NCCL_BACK_SECRET_FILE": str(secret),
        "NCCL_BACK_CACHE_DIR": str(tmp_path / "cache"),
        "NCCL_BACK_ADVERTISE_HOST": "127.0.0.1",
    }


def run_check(env: dict[str, str], *args: str, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, *python, "-m", "nccl_back.cli", "check",
            "--health-port", str(free_port()), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=100)


def lines(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """Each check's line, by check name."""
    out = {}
    for line in proc.stdout.splitlines():
        _, name, _ = line.split(maxsplit=2)
        out[name] = line
    return out


def test_healthy_setup_is_ok_on_every_line(env: dict[str, str], ckpt: Path) -> None:
    """Real Redis, a secret file, free ports, a writable cache, a local model: exit 0, all ok."""
    proc = run_check(env, "--model", str(ckpt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = lines(proc)
    assert list(got) == ["settings", "redis", "namespace", "secret", "advertise", "rendezvous",
                         "health", "transports", "cache", "storage"]
    for line in got.values():
        assert line.startswith("ok "), line
    assert "gloo" in got["transports"]
    assert "version " in got["storage"] and "2 shard(s)" in got["storage"]
    assert SECRET not in proc.stdout


def test_healthy_line_hides_the_redis_password(env: dict[str, str], redis_pw: LocalRedis) -> None:
    """The redis line names the URL with its (URL-encoded) password replaced by ***."""
    proc = run_check({**env, "NCCL_BACK_REDIS_URL": redis_pw.url.replace("right-pw", "right%2Dpw")},
                     *NO_TORCH)
    assert proc.returncode == 0, proc.stdout
    assert ":***@127.0.0.1" in lines(proc)["redis"] and "right" not in proc.stdout


def test_healthy_gcs_model_as_json(env: dict[str, str], ckpt: Path, gcs: LocalGCS) -> None:
    """--json parses: ok true, every check ok, the gs:// model's version as fingerprint gives it."""
    bucket = gcs.client().create_bucket(f"check-{os.getpid()}-{free_port()}")
    for f in sorted(os.listdir(ckpt)):
        bucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
    env = {**env, "STORAGE_EMULATOR_HOST": gcs.host}
    proc = run_check(env, "--model", f"gs://{bucket.name}/m", "--json", *NO_TORCH)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status.pop("transports") == "skip"
    assert set(status.values()) == {"ok"}
    fp = subprocess.run([sys.executable, "-m", "nccl_back.cli", "fingerprint", str(ckpt), "--json"],
                        env=env, capture_output=True, text=True, timeout=60, check=True)
    storage = next(c for c in report["checks"] if c["name"] == "storage")
    assert json.loads(fp.stdout)["version"] in storage["detail"]


def test_checks_other_than_transports_do_not_import_torch(env: dict[str, str], ckpt: Path) -> None:
    """With --skip transports every other check passes and torch is never imported."""
    proc = run_check(env, "--model", str(ckpt), *NO_TORCH, python=("-X", "importtime"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:") and line.count("|") == 2}
    assert "nccl_back.check" in modules and "redis" in modules  # the import list is real
    assert "torch" not in modules




def _fail(proc: subprocess.CompletedProcess[str], name: str, problem: str, fix: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    line = lines(proc)[name]
    assert line.startswith("FAIL "), line
    problem_text, _, fix_text = line.partition("; fix: ")
    assert problem in problem_text, line
    assert fix in fix_text, line


def test_unreachable_redis(env: dict[str, str]) -> None:
    """Nothing listens at the URL: redis fails with 'start Redis'; namespace is skipped."""
    proc = run_check({**env, "NCCL_BACK_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}, *NO_TORCH)
    _fail(proc, "redis", "Connection refused", "start Redis or correct host and port")
    assert lines(proc)["namespace"].startswith("skip ")


def test_wrong_redis_password(env: dict[str, str], redis_pw: LocalRedis) -> None:
    """A wrong password: redis fails naming the URL (password hidden) and the fix."""
    proc = run_check({**env, "NCCL_BACK_REDIS_URL": redis_pw.url.replace("right-pw", "wrong%40pw")},
                     *NO_TORCH)
    _fail(proc, "redis", "invalid username-password", "put the Redis password in NCCL_BACK_REDIS_URL")
    assert "pw" not in proc.stdout.replace("PASSWORD", "") and ":***@" in proc.stdout


def test_redis_password_missing(env: dict[str, str], redis_pw: LocalRedis) -> None:
    """No password for a server that requires one: the same fix."""
    proc = run_check({**env, "NCCL_BACK_REDIS_URL": redis_pw.url.replace(":right-pw@", "")}, *NO_TORCH)
    _fail(proc, "redis", "Authentication required", "put the Redis password in NCCL_BACK_REDIS_URL")


def test_bad_tls_ca(env: dict[str, str], redis_server: LocalRedis, pki: dict[str, str]) -> None:  # noqa: F811
    """rediss:// with a CA that did not sign the server: fails naming the URL's ?ssl_ca_certs=;
    with the right CA the line says the certificate was verified."""
    with TLSTerminator(redis_server.port, pki["server"], pki["server_key"]) as t:
        url = f"rediss://127.0.0.1:{t.port}/0?ssl_ca_certs="
        proc = run_check({**env, "NCCL_BACK_REDIS_URL": url + pki["other_ca"]}, *NO_TORCH)
        _fail(proc, "redis", "TLS certificate verification failed", "?ssl_ca_certs=PATH in NCCL_BACK_REDIS_URL")
        good = run_check({**env, "NCCL_BACK_REDIS_URL": url + pki["ca"]}, *NO_TORCH)
        assert good.returncode == 0, good.stdout
        assert "TLS certificate and host name verified" in lines(good)["redis"]


@pytest.mark.timeout(180)
def test_sentinel_and_cluster_urls(env: dict[str, str]) -> None:
    """redis+sentinel:// and redis+cluster:// URLs are checked as the worker connects; a wrong
    Sentinel service name fails naming the service."""
    with LocalSentinel(password="pw") as sentinel:
        proc = run_check({**env, "NCCL_BACK_REDIS_URL": sentinel.url}, *NO_TORCH)
        assert proc.returncode == 0, proc.stdout
        assert "(sentinel, no TLS): PING" in lines(proc)["redis"]
        wrong = sentinel.url.replace("/mymaster/", "/othermaster/")
        proc = run_check({**env, "NCCL_BACK_REDIS_URL": wrong}, *NO_TORCH)
        _fail(proc, "redis", "no sentinel named a master 'othermaster'", "the service name")
    with LocalRedisCluster(masters=3) as cluster:
        proc = run_check({**env, "NCCL_BACK_REDIS_URL": cluster.url}, *NO_TORCH)
        assert proc.returncode == 0, proc.stdout
        assert "(cluster, no TLS): PING" in lines(proc)["redis"]
        assert lines(proc)["namespace"].startswith("ok ")


def test_peer_records_signed_with_another_secret(env: dict[str, str], redis_url: str,
                                                 namespace: str) -> None:
    """A peer published with another fleet's secret: namespace fails, naming the secret fix."""
    other = Registry(Settings(redis_url=redis_url, namespace=namespace, secret="o" * 32))
    other.publish_peer(_info("stranger"))
    other.close()
    proc = run_check(env, *NO_TORCH)
    _fail(proc, "namespace", "1 peer record(s) rejected (signed with another secret", "same secret")


def test_missing_secret(env: dict[str, str]) -> None:
    """No fleet secret: secret fails with how to make one; the other checks still run."""
    env = {k: v for k, v in env.items() if k != "NCCL_BACK_SECRET_FILE"}
    proc = run_check(env, *NO_TORCH)
    _fail(proc, "secret", "no fleet secret", "openssl rand -hex 32")
    assert lines(proc)["namespace"].startswith("ok ")


def test_short_secret(env: dict[str, str]) -> None:
    """A secret under 16 bytes fails without echoing it."""
    env = {k: v for k, v in env.items() if k != "NCCL_BACK_SECRET_FILE"}
    proc = run_check({**env, "NCCL_BACK_SECRET": "short-one"}, *NO_TORCH)
    _fail(proc, "secret", "at least 16 bytes", "NCCL_BACK_SECRET_FILE")
    assert "short-one" not in proc.stdout


def test_unreadable_secret_file(env: dict[str, str], tmp_path: Path) -> None:
    """A secret file that does not exist is named."""
    proc = run_check({**env, "NCCL_BACK_SECRET_FILE": str(tmp_path / "nope")}, *NO_TORCH)
    _fail(proc, "secret", "cannot read the secret", "NCCL_BACK_SECRET_FILE")


def test_advertise_address_not_on_this_host(env: dict[str, str]) -> None:
    """An advertised address of another host (TEST-NET-1): advertise and rendezvous fail."""
    proc = run_check({**env, "NCCL_BACK_ADVERTISE_HOST": "192.0.2.1"}, *NO_TORCH)
    _fail(proc, "advertise", "'192.0.2.1' (192.0.2.1) is not an address of this host",
          "NCCL_BACK_ADVERTISE_HOST")
    _fail(proc, "rendezvous", "ephemeral transport port: cannot listen on 192.0.2.1:0",
          "NCCL_BACK_ADVERTISE_HOST")


def test_advertise_name_that_does_not_resolve(env: dict[str, str]) -> None:
    """An advertised name that does not resolve is named."""
    proc = run_check({**env, "NCCL_BACK_ADVERTISE_HOST": "no-such-host.invalid"}, *NO_TORCH)
    _fail(proc, "advertise", "'no-such-host.invalid' does not resolve", "NCCL_BACK_ADVERTISE_HOST")


def test_rendezvous_probes_an_ephemeral_port_of_the_advertised_address(env: dict[str, str]) -> None:
    """The rendezvous opens no port: the line probes an ephemeral port of the advertised address."""
    proc = run_check(env, *NO_TORCH)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = lines(proc)["rendezvous"]
    assert line.startswith("ok ") and "ephemeral transport port" in line, line
    assert "listens on 127.0.0.1" in line, line


def test_health_port_in_use(env: dict[str, str], busy_port: int) -> None:
    """A health port another process listens on fails naming --health-port."""
    proc = run_check(env, *NO_TORCH, "--health-port", str(busy_port))
    _fail(proc, "health", f"127.0.0.1:{busy_port} (in use by another process)", "--health-port")


def test_unwritable_cache_dir(env: dict[str, str], tmp_path: Path) -> None:
    """A cache directory that cannot be made (its parent is a file) fails naming it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_check({**env, "NCCL_BACK_CACHE_DIR": str(blocker / "cache")}, *NO_TORCH)
    _fail(proc, "cache", f"{str(blocker / 'cache')!r}: not writable", "NCCL_BACK_CACHE_DIR")


def test_missing_model(env: dict[str, str], tmp_path: Path) -> None:
    """A --model directory that does not exist fails naming it."""
    proc = run_check(env, "--model", str(tmp_path / "no-model"), *NO_TORCH)
    _fail(proc, "storage", "not found", "config.json and *.safetensors")


def test_missing_gcs_model(env: dict[str, str], gcs: LocalGCS) -> None:
    """A gs:// prefix with nothing under it fails naming it."""
    proc = run_check({**env, "STORAGE_EMULATOR_HOST": gcs.host}, "--model", "gs://no-such-bucket/m",
                     *NO_TORCH)
    _fail(proc, "storage", "gs://no-such-bucket/m", "gs://bucket/prefix")


def test_bad_setting_skips_the_rest(env: dict[str, str]) -> None:
    """An unparsable setting fails the settings line; checks needing Settings are skipped; JSON parses."""
    proc = run_check({**env, "NCCL_BACK_TRANSFER_TIMEOUT": "soon"}, "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    status = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False
    assert "NCCL_BACK_TRANSFER_TIMEOUT='soon'" in status["settings"]["detail"]
    assert status["redis"]["status"] == "skip" and status["secret"]["status"] == "ok"


def test_unknown_skip_name_is_one_line_error(env: dict[str, str]) -> None:
    """--skip with a name that is no check: one line naming it and the choices, exit 1."""
    proc = run_check(env, "--skip", "bogus")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--skip bogus: no such check" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here: nccl is available")
def test_nccl_without_cuda(env: dict[str, str]) -> None:
    """transport=nccl on a machine without CUDA: transports fails with the fix."""
    proc = run_check({**env, "NCCL_BACK_TRANSPORT": "nccl"})
    _fail(proc, "transports", "CUDA is not available here", "NCCL_BACK_TRANSPORT=gloo")


def test_a_retired_setting_fails_naming_its_replacement(env: dict[str, str]) -> None:
    """A retired NCCL_BACK_* variable fails the settings check naming what replaces it; a retired
    flag is one usage line naming it, exit 2."""
    proc = run_check({**env, "NCCL_BACK_BUSY_WAIT": "5"}, *NO_TORCH)
    _fail(proc, "settings", "NCCL_BACK_BUSY_WAIT: setting retired; derived: half of transfer_timeout",
          "NCCL_BACK_*")
    proc = run_check(env, *NO_TORCH, "--receiver-handshake-timeout", "3")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "--receiver-handshake-timeout: setting retired; set handshake_timeout" in proc.stderr
