"""az:// through azure-storage-blob against a real Azurite (Microsoft's Azure Storage
emulator, installed from the npm registry and started by the test run): URIs, the
credentials Azure users set, listing, CRC32C computed once (pinned to the ETag) and
cached, ranged parallel verified downloads through faults, one version with the same
bytes on disk, GCS, S3 and Azure, a storage and a peer load, the cooperative download's
ranged shares, a TP=2 ranged load, and the errors a user sees.

Faults and request counts come from the real HTTP proxy of tests/test_storage.py, which
the client reaches through the connection string's ``BlobEndpoint``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_storage import FaultProxy, _NoWaits

from nccl_back import _clock
from nccl_back.check import Target, check_storage
from nccl_back.config import Settings
from nccl_back.dev.azurite import ACCOUNT, LocalAzurite
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.s3_emulator import LocalS3
from nccl_back.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    ConfigError,
    ShardNotFoundError,
    StorageError,
)
from nccl_back.load.service import WeightService
from nccl_back.model.az import AzureBlobs, sas_expiry
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.skeleton import build, named_tensors
from nccl_back.model.storage import Shard, Storage, parse_uri

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(60)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _crc(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def az_media(method: str, path: str) -> bool:
    """An Azure Get Blob (path-style /account/container/blob; not a listing)."""
    return method == "GET" and "comp=" not in path and "restype=" not in path


def _shard_gets(proxy: FaultProxy) -> list[str]:
    return [p for p in proxy.media_requests() if p.split("?")[0].endswith(".safetensors")]


@pytest.fixture(autouse=True)
def _instant_retries() -> Iterator[None]:
    with _clock.use(_NoWaits()):  # retry paths take milliseconds
        yield


@pytest.fixture
def client(azurite: LocalAzurite) -> Any:
    return azurite.client()


@pytest.fixture
def container(client: Any) -> str:
    """A fresh container on Azurite."""
    name = "c" + uuid.uuid4().hex[:12]
    client.create_container(name)
    return name


@pytest.fixture
def proxy(azurite: LocalAzurite) -> Iterator[FaultProxy]:
    p = FaultProxy(f"http://127.0.0.1:{azurite.port}", media=az_media).start()
    yield p
    p.stop()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 4), tmp_path / "ckpt", n_shards=3)


def _store(env: dict[str, str], cache_dir: str, **settings: Any) -> Storage:
    config = Settings(cache_dir=cache_dir, **settings)
    return Storage(config, backends={"az": AzureBlobs(config, env=env)})


def _via(azurite: LocalAzurite, proxy: FaultProxy) -> dict[str, str]:
    """The environment that sends az:// requests through ``proxy``."""
    return {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string(f"{proxy.host}/{ACCOUNT}")}


def put(client: Any, container: str, name: str, data: bytes) -> None:
    client.get_blob_client(container, name).upload_blob(data, overwrite=True)


def upload_dir(client: Any, container: str, prefix: str, ckpt: Path) -> None:
    for f in sorted(os.listdir(ckpt)):
        put(client, container, f"{prefix}/{f}", (ckpt / f).read_bytes())


# -- URIs, listings, credentials (no server) ----------------------------------------------


def test_az_uri_forms() -> None:
    """az://container/prefix parses to a canonical remote location; join adds a blob name."""
    loc = parse_uri("az://my-models/a/b/")
    assert (loc.scheme, loc.bucket, loc.path, loc.uri) == ("az", "my-models", "a/b", "az://my-models/a/b")
    assert not loc.is_local
    assert loc.join("c.json").uri == "az://my-models/a/b/c.json"
    assert parse_uri("az://abc").uri == "az://abc/"


@pytest.mark.parametrize("uri", ["az://", "az://ab/x", "az://Models/x", "az://my--models/x",
                                 "az://-models/x", "az://models-/x", "az://my_models/x",
                                 "az://" + "a" * 64 + "/x"])
def test_bad_az_uri_is_refused_naming_it(uri: str) -> None:
    """A container name Azure would refuse is a ConfigError naming the URI, the rules and the form."""
    with pytest.raises(ConfigError, match=rf"storage URI {uri!r}: bad container name .*"
                       r"lowercase letters.*use az://container/prefix"):
        parse_uri(uri)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_az_uri_parses_or_is_a_config_error(rest: str) -> None:
    """Whatever follows az://, parsing gives a location that round-trips, or a ConfigError."""
    try:
        loc = parse_uri("az://" + rest)
    except ConfigError as e:
        assert "az://" in str(e)
        return
    assert 3 <= len(loc.bucket) <= 63 and "--" not in loc.bucket
    assert parse_uri(loc.uri) == loc


_entry = st.builds(SimpleNamespace, **{
    "name": st.one_of(st.text(max_size=12), st.just("m/"), st.text(max_size=8).map(lambda t: "m/" + t),
                      st.integers(), st.none()),
    "size": st.one_of(st.integers(-5, 10**12), st.text(max_size=3), st.none(), st.floats(), st.booleans()),
    "etag": st.one_of(st.text(max_size=8), st.none(), st.integers(), st.just('""')),
})


@settings(max_examples=300, deadline=None)
@given(_entry)
def test_any_listing_entry_is_a_blob_or_skipped(item: Any) -> None:
    """Whatever a listing entry holds, it becomes a blob directly under the prefix with a
    size and a quoted ETag, or it is skipped; it never raises."""
    info = AzureBlobs(Settings(), env={})._object_info(parse_uri("az://ctr/m"), "m/", item)
    if info is not None:
        assert info.uri == f"az://ctr/m/{info.name}" and info.name and "/" not in info.name
        assert type(info.size) is int and info.size >= 0
        assert info.tag.startswith('"') and info.tag.endswith('"') and len(info.tag) > 2


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_any_sas_token_gives_an_expiry_or_none(token: str) -> None:
    """Whatever a SAS token holds, its expiry is a time or None; it never raises."""
    got = sas_expiry(token)
    assert got is None or got.year >= 1
    assert sas_expiry("sv=2024&se=2020-01-02T03%3A04%3A05Z&sig=x") is not None


def _how(env: dict[str, str]) -> str:
    return AzureBlobs(Settings(), env=env).describe()


def test_credentials_are_taken_as_azure_users_set_them() -> None:
    """The connection string wins; else the account with its key, a SAS token or
    DefaultAzureCredential, at the default or given endpoint; check names the winner."""
    conn = ("DefaultEndpointsProtocol=https;AccountName=acct1;AccountKey=a2V5;"
            "EndpointSuffix=core.chinacloudapi.cn")
    assert _how({"AZURE_STORAGE_CONNECTION_STRING": conn, "AZURE_STORAGE_ACCOUNT": "other"}) == (
        "account acct1, endpoint https://acct1.blob.core.chinacloudapi.cn/, credentials from"
        " AZURE_STORAGE_CONNECTION_STRING (account key)")
    assert _how({"AZURE_STORAGE_ACCOUNT": "acct1", "AZURE_STORAGE_KEY": "a2V5",
                 "AZURE_STORAGE_SAS_TOKEN": "sv=1&sig=x"}).endswith("credentials from account key")
    assert _how({"AZURE_STORAGE_ACCOUNT_NAME": "acct1", "AZURE_STORAGE_SAS_TOKEN": "?sv=1&sig=x",
                 "AZURE_STORAGE_SERVICE_ENDPOINT": "http://127.0.0.1:1/acct1"}) == (
        "account acct1, endpoint http://127.0.0.1:1/acct1/, credentials from SAS token")
    # No request is made: DefaultAzureCredential finds its credential on the first token.
    assert _how({"AZURE_STORAGE_ACCOUNT": "acct1"}) == (
        "account acct1, endpoint https://acct1.blob.core.windows.net/, credentials from"
        " DefaultAzureCredential")


@pytest.mark.parametrize(("env", "error", "match"), [
    ({}, StorageError, r"listing az://ctr/m: no Azure storage account: set"
                       r" AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with"),
    ({"AZURE_STORAGE_CONNECTION_STRING": "nonsense"}, StorageError,
     r"listing az://ctr/m: AZURE_STORAGE_CONNECTION_STRING is malformed"),
    ({"AZURE_STORAGE_ACCOUNT": "Bad_Name"}, ConfigError,
     r"AZURE_STORAGE_ACCOUNT='Bad_Name': give 3-24 lowercase letters and digits"),
    ({"AZURE_STORAGE_ACCOUNT": "acct1", "AZURE_STORAGE_SERVICE_ENDPOINT": "acct1.example:9"},
     ConfigError, r"AZURE_STORAGE_SERVICE_ENDPOINT='acct1.example:9': give http\(s\)://host"),
])
def test_missing_or_bad_account_is_one_line_naming_the_fix(
    env: dict[str, str], error: type[Exception], match: str, cache_dir: str
) -> None:
    """No account, a malformed connection string, a bad account name or endpoint: a typed
    error naming the URI or the variable and the fix, never the secret."""
    with pytest.raises(error, match=match) as e:
        _store(env, cache_dir).list_dir("az://ctr/m")
    assert "\n" not in str(e.value) and "nonsense" not in str(e.value)


# -- listing, checksums, identity ---------------------------------------------------------


def test_listing_gives_direct_blobs_with_sizes_and_etags(
    azurite: LocalAzurite, client: Any, container: str, cache_dir: str
) -> None:
    """A listing has the blobs directly under the prefix, with size and quoted ETag, sorted."""
    put(client, container, "m/b.bin", b"0123456789")
    put(client, container, "m/a.json", b"{}")
    put(client, container, "m/sub/deeper.bin", b"x")
    put(client, container, "other/c.bin", b"y")
    infos = _store(azurite.env, cache_dir).list_dir(f"az://{container}/m")
    assert [(i.name, i.size, i.crc32c) for i in infos] == [("a.json", 2, None), ("b.bin", 10, None)]
    assert all(i.uri == f"az://{container}/m/{i.name}" and i.tag.startswith('"0x') for i in infos)


def test_reads_give_the_stored_bytes_as_they_are(
    azurite: LocalAzurite, client: Any, container: str, cache_dir: str
) -> None:
    """A blob stored with Content-Encoding gzip reads as its stored bytes (never
    decompressed: ranges of it are checksummed as stored); an empty blob reads as b"",
    and a range past a blob's end as b""."""
    from azure.storage.blob import ContentSettings

    data = b"not gzip at all" * 10
    client.get_blob_client(container, "m/enc.bin").upload_blob(
        data, content_settings=ContentSettings(content_encoding="gzip"))
    put(client, container, "m/empty.json", b"")
    store = _store(azurite.env, cache_dir)
    assert store.read_range(f"az://{container}/m/enc.bin", 3, 40) == data[3:40]
    assert store.read_bytes(f"az://{container}/m/enc.bin", max_bytes=1000) == data
    assert store.read_bytes(f"az://{container}/m/empty.json", max_bytes=10) == b""
    assert store.read_range(f"az://{container}/m/enc.bin", 1000, 1010) == b""
    infos = store.list_dir(f"az://{container}/m")
    assert store.crc32cs(infos) == [_crc(b""), _crc(data)]


@pytest.mark.timeout(120)
def test_same_bytes_give_one_version_on_disk_gcs_s3_and_azure(
    gcs: LocalGCS, s3: LocalS3, azurite: LocalAzurite, client: Any, container: str,
    ckpt: Path, cache_dir: str,
) -> None:
    """Local files, the GCS emulator, S3 (moto) and Azure (Azurite) copies of the same
    files are one version: the content version does not depend on the cloud."""
    upload_dir(client, container, "deep/m", ckpt)
    s3c, sbucket = s3.client(), "b" + uuid.uuid4().hex[:12]
    s3c.create_bucket(Bucket=sbucket)
    gbucket = gcs.client().create_bucket("g" + uuid.uuid4().hex[:12])
    for f in sorted(os.listdir(ckpt)):
        s3c.put_object(Bucket=sbucket, Key=f"m/{f}", Body=(ckpt / f).read_bytes())
        gbucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
    local = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    specs = [ModelSpec.from_dir(uri, cache_dir=cache_dir) for uri in (
        f"gs://{gbucket.name}/m", f"s3://{sbucket}/m", f"az://{container}/deep/m")]
    assert [s.version for s in specs] == [local.version] * 3
    assert [(s.name, s.size, s.crc32c) for s in specs[2].shards] == \
        [(s.name, s.size, s.crc32c) for s in local.shards]


def test_crc32c_is_computed_once_pinned_to_the_etag_then_cached(
    azurite: LocalAzurite, client: Any, container: str, ckpt: Path, proxy: FaultProxy, cache_dir: str
) -> None:
    """Azure keeps no CRC32C: a spec reads each shard once, in ranged GETs pinned by
    If-Match to the listed ETag; a restart with the same cache reads no shard byte."""
    upload_dir(client, container, "m", ckpt)
    pinned: list[str] = []
    proxy.before = lambda m, p, h: pinned.append(p) if h.get("If-Match") else None
    first = ModelSpec.from_dir(f"az://{container}/m", storage=_store(_via(azurite, proxy), cache_dir))
    local = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir + "-local")
    assert first.version == local.version
    gets = _shard_gets(proxy)
    assert len(gets) == 3 and sorted(gets) == sorted(pinned)
    proxy.requests.clear()
    again = ModelSpec.from_dir(f"az://{container}/m", storage=_store(_via(azurite, proxy), cache_dir))
    assert again.version == first.version and _shard_gets(proxy) == []


def test_a_large_blob_is_checksummed_in_parallel_ranges(
    azurite: LocalAzurite, client: Any, container: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A blob larger than a chunk is read for its CRC32C in ranges (4 for 13 MiB in
    4 MiB chunks), their CRCs combined into the whole blob's."""
    data = np.random.default_rng(1).integers(0, 256, (12 << 20) + 5, dtype=np.uint8).tobytes()
    put(client, container, "m/big.bin", data)
    store = _store(_via(azurite, proxy), cache_dir, chunk_bytes=4 << 20, storage_workers=4)
    assert store.crc32cs(store.list_dir(f"az://{container}/m")) == [_crc(data)]
    assert len(proxy.media_requests()) == 4


def test_blob_replaced_mid_read_is_an_error_not_a_mixed_file(
    azurite: LocalAzurite, client: Any, container: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A blob replaced while it is read for its CRC32C fails that read (nothing cached);
    one replaced between a download's chunks fails its CRC32C on every download: the
    mixed bytes are never a version, nor a shard's content."""
    old = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    new = (np.frombuffer(old, dtype=np.uint8) ^ 0xFF).tobytes()
    put(client, container, "m/a.bin", old)
    store = _store(_via(azurite, proxy), cache_dir, chunk_bytes=1 << 20, storage_workers=1,
                   storage_attempts=2)
    infos = store.list_dir(f"az://{container}/m")
    seen: list[str] = []

    def replace_at_second(method: str, path: str, headers: Any) -> None:
        if az_media(method, path):
            seen.append(path)
            if len(seen) == 2:
                put(client, container, "m/a.bin", new)

    proxy.before = replace_at_second
    with pytest.raises(StorageError, match=rf"reading az://{container}/m/a\.bin \[1048576, 2097152\)"
                       r" for its CRC32C: the blob was replaced while it was read; run again"):
        store.crc32cs(infos)
    assert not Path(cache_dir, "crc32c-v1.json").exists()

    put(client, container, "m/a.bin", old)
    seen.clear()
    shard = Shard(f"az://{container}/m/a.bin", _crc(old), len(old))
    with pytest.raises(ChecksumMismatchError, match=r"a\.bin: CRC32C differs .* after 2 downloads"):
        store.download(shard)


# -- downloads ----------------------------------------------------------------------------


def test_download_in_parallel_ranges_exact_bytes(
    azurite: LocalAzurite, client: Any, container: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A shard larger than chunk_bytes arrives intact as ranged GETs, one per chunk."""
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    put(client, container, "x/data.bin", data)
    shard = Shard(f"az://{container}/x/data.bin", _crc(data), len(data))
    buf = _store(_via(azurite, proxy), cache_dir, chunk_bytes=16_384).download(shard)
    assert buf.tobytes() == data
    assert len(proxy.media_requests()) == 7


def test_503s_and_corruption_are_retried_and_persistent_ones_give_up(
    azurite: LocalAzurite, client: Any, container: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A few 503s are retried to the exact bytes, a flipped byte downloads again; 503s on
    every attempt are a StorageError after storage_attempts naming the range."""
    data = b"weights" * 1000
    put(client, container, "x/data.bin", data)
    shard = Shard(f"az://{container}/x/data.bin", _crc(data), len(data))
    env = _via(azurite, proxy)
    proxy.fail, proxy.corrupt = 3, 1
    assert _store(env, cache_dir, storage_attempts=5).download(shard).tobytes() == data
    assert len(proxy.media_requests()) == 5 and (proxy.fail, proxy.corrupt) == (0, 0)
    proxy.fail = 1000
    with pytest.raises(StorageError, match=rf"^downloading az://{container}/x/data\.bin \[0, 7000\):"
                       r" failed after 3 attempts: 503$"):
        _store(env, cache_dir, storage_attempts=3).download(shard)


def test_unreachable_endpoint_is_clear(azurite: LocalAzurite, cache_dir: str) -> None:
    """An endpoint that does not answer HTTP is a StorageError after storage_attempts
    naming it and where it is set."""
    from nccl_back.dev.servers import free_port

    dead = f"http://127.0.0.1:{free_port()}/{ACCOUNT}"
    store = _store({"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string(dead)}, cache_dir,
                   storage_attempts=2)
    with pytest.raises(StorageError, match=rf"^listing az://ctr/m: failed after 2 attempts: .*"
                       rf"\(endpoint {dead}/; set AZURE_STORAGE_SERVICE_ENDPOINT \(or BlobEndpoint="):
        store.list_dir("az://ctr/m")


def test_server_ignoring_range_is_refused(
    azurite: LocalAzurite, client: Any, container: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A server that answers ranged GETs with the whole blob is a StorageError saying so,
    never bytes at the wrong offset."""
    data = np.random.default_rng(2).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    put(client, container, "x/data.bin", data)
    shard = Shard(f"az://{container}/x/data.bin", _crc(data), len(data))
    # A SAS signs no header, so the proxy may drop the range (an account key signs x-ms-*).
    env = {"AZURE_STORAGE_ACCOUNT": ACCOUNT, "AZURE_STORAGE_SERVICE_ENDPOINT": f"{proxy.host}/{ACCOUNT}",
           "AZURE_STORAGE_SAS_TOKEN": azurite.sas(container)}
    proxy.before = lambda m, p, h: h.__delitem__("x-ms-range")
    with pytest.raises(StorageError, match=r"downloading az://.*data\.bin \[\d+, \d+\): the server"
                       r" (sent more than the 16384 bytes requested|answered Range bytes=)"):
        _store(env, cache_dir, chunk_bytes=16_384, storage_workers=1).download(shard)


def test_stalled_server_times_out(
    azurite: LocalAzurite, client: Any, container: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A server that stops answering costs each attempt its read timeout, then a StorageError."""
    put(client, container, "x/data.bin", b"w" * 100)
    shard = Shard(f"az://{container}/x/data.bin", _crc(b"w" * 100), 100)
    proxy.before = lambda m, p, h: time.sleep(5) if m == "GET" else None
    config = Settings(cache_dir=cache_dir, storage_attempts=2)
    store = Storage(config, timeout=0.5, backends={
        "az": AzureBlobs(config, timeout=0.5, env=_via(azurite, proxy))})
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"data\.bin \[0, 100\): failed after 2 attempts"):
        store.download(shard)
    assert time.monotonic() - t0 < 4  # two 0.5 s timeouts, not the server's 5 s stall


def test_storage_load_through_faults_gives_exact_weights(
    azurite: LocalAzurite, client: Any, container: str, tmp_path: Path, proxy: FaultProxy,
    cache_dir: str,
) -> None:
    """A storage load from az:// through 503s and a corrupted chunk yields the exact weights."""
    model = fill_random(TinyTransformer(), 3)
    upload_dir(client, container, "m", write_checkpoint(model, tmp_path / "c", n_shards=2))
    store = _store(_via(azurite, proxy), cache_dir, chunk_bytes=8192)
    spec = ModelSpec.from_dir(f"az://{container}/m", storage=store)
    proxy.fail, proxy.corrupt, proxy.corrupt_from = 2, 1, 1  # header reads start at 0
    skeleton = build(TinyTransformer)
    result = load_from_storage(skeleton, spec, storage=store)
    expected, _ = named_tensors(model)
    got, _ = named_tensors(skeleton)
    assert all(_raw(expected[n]) == _raw(got[n]) for n in expected)
    assert result.source == "storage" and (proxy.fail, proxy.corrupt) == (0, 0)


# -- errors a user sees -------------------------------------------------------------------


def test_config_larger_than_its_bound_is_refused_by_its_size(
    azurite: LocalAzurite, client: Any, container: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A config.json the store says is over its 16 MiB bound is refused by that size, in
    one GET whose body is not read: CheckpointFormatError naming the blob."""
    put(client, container, "m/config.json", b" " * ((16 << 20) + 1))
    with pytest.raises(CheckpointFormatError, match=rf"az://{container}/m/config\.json: 16777217"
                       r" bytes, over the 16777216-byte limit"):
        ModelSpec.from_dir(f"az://{container}/m", storage=_store(_via(azurite, proxy), cache_dir))
    assert [p.split("?")[0] for p in proxy.media_requests()] == [f"/{ACCOUNT}/{container}/m/config.json"]


def test_wrong_size_and_missing_blob_name_them(
    azurite: LocalAzurite, client: Any, container: str, cache_dir: str
) -> None:
    """A blob shorter than its spec says, or missing: one line naming the blob and the fix."""
    put(client, container, "x/short.bin", b"s" * 100)
    store = _store(azurite.env, cache_dir)
    with pytest.raises(StorageError, match=rf"downloading az://{container}/x/short\.bin \[0, 500\):"
                       r" the blob is 100 bytes, not the 500 or more listed; it changed after it"
                       r" was listed: run again"):
        store.download(Shard(f"az://{container}/x/short.bin", "00000000", 500))
    with pytest.raises(ShardNotFoundError, match=rf"downloading az://{container}/x/gone\.safetensors"
                       r" \[0, 10\): not found"):
        store.download(Shard(f"az://{container}/x/gone.safetensors", "00000000", 10))
    with pytest.raises(ShardNotFoundError, match=rf"'az://{container}/empty/config\.json' does not exist"):
        ModelSpec.from_dir(f"az://{container}/empty", storage=store)


def test_missing_container_is_one_line_naming_it(azurite: LocalAzurite, cache_dir: str) -> None:
    """A container that does not exist: ShardNotFoundError naming the URI, the account and the fix."""
    with pytest.raises(ShardNotFoundError) as e:
        ModelSpec.from_dir("az://no-such-container/m", storage=_store(azurite.env, cache_dir))
    text = str(e.value)
    assert "\n" not in text
    assert "checkpoint 'az://no-such-container/m' not found" in text
    assert (f"container 'no-such-container' does not exist in account {ACCOUNT}"
            f" ({azurite.endpoint}/); check the name, or the account") in text


def test_sas_and_account_key_read_and_an_expired_sas_says_so(
    azurite: LocalAzurite, client: Any, container: str, cache_dir: str
) -> None:
    """The account with a SAS token or its key reads; an expired SAS token is a
    StorageError naming the URI, its expiry and the fix, without retries."""
    from nccl_back.dev.azurite import KEY

    put(client, container, "m/a.bin", b"a")
    account = {"AZURE_STORAGE_ACCOUNT": ACCOUNT, "AZURE_STORAGE_SERVICE_ENDPOINT": azurite.endpoint}
    for cred in ({"AZURE_STORAGE_SAS_TOKEN": azurite.sas(container)}, {"AZURE_STORAGE_KEY": KEY}):
        assert [i.name for i in _store({**account, **cred}, cache_dir).list_dir(f"az://{container}/m")] == ["a.bin"]
    expired = {**account, "AZURE_STORAGE_SAS_TOKEN": azurite.sas(container, expires_in=-3600)}
    with pytest.raises(StorageError, match=rf"^listing az://{container}/m: access denied"
                       r" \(\w+\): the SAS token expired at 20\d\d-.*; give a fresh one"
                       r" \(AZURE_STORAGE_SAS_TOKEN"):
        _store(expired, cache_dir).list_dir(f"az://{container}/m")


def test_check_names_the_account_endpoint_and_credential(
    azurite: LocalAzurite, client: Any, container: str, ckpt: Path, cache_dir: str
) -> None:
    """`nccl-back check --model az://...` reads the spec and a shard's first bytes, naming
    the account, the endpoint and which credential won; a missing container fails naming it."""
    upload_dir(client, container, "m", ckpt)
    config = Settings(cache_dir=cache_dir)
    good = check_storage(Target(model_uri=f"az://{container}/m"), config)
    assert good.status == "ok", good
    assert (f"(account {ACCOUNT}, endpoint {azurite.endpoint}/, credentials from"
            " AZURE_STORAGE_CONNECTION_STRING (account key))") in good.detail
    bad = check_storage(Target(model_uri="az://no-such-container/m"), config)
    assert bad.status == "fail" and "container 'no-such-container' does not exist" in bad.detail
    assert "az://container/prefix" in (bad.fix or "")


# -- loads: storage, peer, cooperative shares, TP=2 ranged --------------------------------


@pytest.mark.timeout(120)
def test_storage_load_then_peer_load_of_an_az_checkpoint(
    azurite: LocalAzurite, client: Any, container: str, ckpt: Path,
    redis_url: str, namespace: str, cache_dir: str,
) -> None:
    """A worker loads an az:// checkpoint from storage, verified; a second one reading the
    same az:// prefix receives it from the first over the peer path, exact bytes."""
    upload_dir(client, container, "m", ckpt)
    config = Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                      cache_dir=cache_dir, peer_ttl=3.0,
                      transfer_timeout=20.0, handshake_timeout=5.0)
    spec = ModelSpec.from_dir(f"az://{container}/m", settings=config)
    expected, _ = named_tensors(fill_random(TinyTransformer(), 4))
    with WeightService(config) as seed:
        first = seed.load(build(TinyTransformer), spec)
        assert (first.source, first.verified) == ("storage", True)
        with WeightService(config) as receiver:
            model = build(TinyTransformer)
            second = receiver.load(model, ModelSpec.from_dir(f"az://{container}/m", settings=config))
    assert (second.source, second.fallback_reason, second.verified) == ("peer", None, True)
    got, _ = named_tensors(model)
    assert sorted(got) == sorted(expected)
    assert all(_raw(expected[n]) == _raw(got[n]) for n in expected)


def test_cooperative_download_members_read_ranged_shares_of_a_container(
    azurite: LocalAzurite, client: Any, container: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cooperative first download's members read their shares as ranged GETs of the
    container: parts exact, each blob's bytes read once in all, every blob's CRC32C (computed
    once, pinned) proven by the members' interval CRCs combined."""
    from test_share_read import _check_parts, _members, _source

    from nccl_back.load.share_read import prove

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the CRC cache of Settings()
    upload_dir(client, container, "m", write_checkpoint(_source(), tmp_path / "ckpt", n_shards=2))
    spec = ModelSpec.from_dir(f"az://{container}/m")
    models, reads, steps = _members(spec, 3, stage=5000)
    _check_parts(models, steps)
    assert sum(r.bytes for r in reads) == sum(s.size for s in spec.shards)
    prove(spec, reads)


def test_tp2_ranged_load_from_a_container(
    azurite: LocalAzurite, client: Any, container: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TP=2 worker's ranks read only their pieces' spans of the az:// blobs: each rank's
    bytes equal the whole-blob downloads cut, and the ranks' interval CRCs prove every blob."""
    import reshard_workers as rw
    from test_ranged_load import _bytes, _check, _ranged, _rank

    from nccl_back.model.sharding import load_sharded

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=5)
    ckpt = str(write_checkpoint(model, tmp_path / "ckpt", n_shards=2))
    upload_dir(client, container, "m", Path(ckpt))
    spec, models, _, intervals = _ranged(f"az://{container}/m", 2, "megatron", stage=1000)
    for rank, got in enumerate(models):
        want, sh = _rank(ckpt, spec, rank, 2, "megatron")
        load_sharded(want, spec, Settings(), sh)  # the whole-blob downloads, cut
        assert _bytes(got) == _bytes(want)
    _check(spec, intervals)
