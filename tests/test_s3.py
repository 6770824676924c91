"""s3:// through boto3 against a real S3-compatible server (moto's server mode, started
by the test run): URIs, listing, CRC32C from metadata or computed once and cached,
ranged parallel verified downloads through faults, one version with the same bytes on
local disk, GCS and S3, and a peer load between a worker that read S3 and one that
read GCS.

Faults and request counts come from the real HTTP proxy of tests/test_storage.py,
which boto3 reaches as its endpoint (``Settings.s3_endpoint_url``).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_storage import FaultProxy

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.s3_emulator import LocalS3
from nccl_back.errors import ChecksumMismatchError, ConfigError, ShardNotFoundError, StorageError
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.s3 import S3Objects, whole_object_crc32c
from nccl_back.model.skeleton import build, named_tensors
from nccl_back.model.storage import Shard, Storage, parse_uri

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(60)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _b64crc(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def s3_media(method: str, path: str) -> bool:
    """An S3 GetObject (path-style /bucket/key, not a listing)."""
    return method == "GET" and "list-type=" not in path and path.count("/") >= 2


def _heads(proxy: FaultProxy) -> list[str]:
    return [p for m, p in proxy.requests if m == "HEAD"]


def _shard_gets(proxy: FaultProxy) -> list[str]:
    return [p for p in proxy.media_requests() if ".safetensors" in p.split("?")[0]
            and not p.split("?")[0].endswith(".json")]


class _NoWaits(_clock.Clock):
    """Sleeps return at once, so retry paths take milliseconds."""

    def sleep(self, seconds: float) -> None:
        pass


@pytest.fixture(autouse=True)
def _instant_retries() -> Iterator[None]:
    with _clock.use(_NoWaits()):
        yield


@pytest.fixture
def client(s3: LocalS3) -> Any:
    return s3.client()


@pytest.fixture
def bucket(client: Any) -> str:
    """A fresh bucket on the S3 server."""
    name = "b" + uuid.uuid4().hex[:12]
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def proxy(s3: LocalS3) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.endpoint, media=s3_media).start()
    yield p
    p.stop()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 4), tmp_path / "ckpt", n_shards=3)


def _store(endpoint: str, cache_dir: str, **settings: Any) -> Storage:
    return Storage(Settings(s3_endpoint_url=endpoint, cache_dir=cache_dir, **settings))


def put(client: Any, bucket: str, key: str, data: bytes, *, crc32c: bool = True) -> None:
    """Upload ``data``, with its CRC32C in the object's metadata or without one."""
    extra = {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": _b64crc(data)} if crc32c else {}
    client.put_object(Bucket=bucket, Key=key, Body=data, **extra)


def put_multipart(client: Any, bucket: str, key: str, data: bytes, kind: str) -> None:
    """Upload ``data`` in 5 MiB parts with a CRC32C of type ``kind`` (COMPOSITE, FULL_OBJECT)."""
    up = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C",
                                        ChecksumType=kind)
    parts = []
    for i, off in enumerate(range(0, len(data), 5 << 20), start=1):
        part = data[off : off + (5 << 20)]
        r = client.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=i,
                               Body=part, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=_b64crc(part))
        parts.append({"PartNumber": i, "ETag": r["ETag"], "ChecksumCRC32C": _b64crc(part)})
    whole = {"ChecksumCRC32C": _b64crc(data), "ChecksumType": kind} if kind == "FULL_OBJECT" else {}
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": parts}, **whole)


def upload_dir(client: Any, bucket: str, prefix: str, ckpt: Path, *, crc32c: bool = True) -> None:
    for f in sorted(os.listdir(ckpt)):
        put(client, bucket, f"{prefix}/{f}", (ckpt / f).read_bytes(), crc32c=crc32c)


# -- URIs ------------------------------------------------------------------------------


def test_s3_uri_forms() -> None:
    """s3://bucket/prefix parses to a canonical remote location; join adds a key."""
    loc = parse_uri("s3://my-bucket.v2/a/b/")
    assert (loc.scheme, loc.bucket, loc.path, loc.uri) == ("s3", "my-bucket.v2", "a/b", "s3://my-bucket.v2/a/b")
    assert not loc.is_local
    assert loc.join("c.json").uri == "s3://my-bucket.v2/a/b/c.json"
    assert parse_uri("s3://bkt").uri == "s3://bkt/"


@pytest.mark.parametrize("uri", ["s3://", "s3://Bad_Bucket/x", "s3://ab/x", "s3://a..b/x",
                                 "s3://192.168.1.1/x", "s3://-bkt/x", "s3://" + "a" * 64 + "/x"])
def test_bad_s3_uri_is_refused_naming_it(uri: str) -> None:
    """A bucket name S3 would refuse is a ConfigError naming the URI, the rules and the form."""
    with pytest.raises(ConfigError, match=rf"storage URI {uri!r}: bad bucket name .*"
                       r"lowercase letters.*use s3://bucket/prefix"):
        parse_uri(uri)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_s3_uri_parses_or_is_a_config_error(rest: str) -> None:
    """Whatever follows s3://, parsing gives a location that round-trips, or a ConfigError."""
    try:
        loc = parse_uri("s3://" + rest)
    except ConfigError as e:
        assert "s3://" in str(e)
        return
    assert 3 <= len(loc.bucket) <= 63 and loc.bucket == loc.bucket.lower()
    assert parse_uri(loc.uri) == loc


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=20), st.binary(max_size=8).map(
           lambda b: base64.b64encode(b).decode())),
       st.sampled_from([None, "FULL_OBJECT", "COMPOSITE", "other", 3]),
       st.sampled_from([None, '"abc"', '"abc-2"', "abc-12", 7]))
def test_metadata_checksum_is_a_crc_or_absent(value: Any, kind: Any, etag: Any) -> None:
    """Any ChecksumCRC32C a server sends yields 8 hex digits or None; composite ones are None."""
    got = whole_object_crc32c(value, kind, etag)
    assert got is None or (len(got) == 8 and int(got, 16) >= 0)
    multipart = isinstance(etag, str) and "-" in etag
    if kind == "COMPOSITE" or (multipart and kind != "FULL_OBJECT"):
        assert got is None
    if isinstance(value, str) and len(value) == 8 and value.endswith("==") and got is not None:
        assert got == base64.b64decode(value).hex()


_entry = st.fixed_dictionaries({}, optional={
    "Key": st.one_of(st.text(max_size=12), st.just("m/"), st.text(max_size=8).map(lambda t: "m/" + t),
                     st.integers()),
    "Size": st.one_of(st.integers(-5, 10**12), st.text(max_size=3), st.none(), st.floats()),
    "ETag": st.one_of(st.text(max_size=8), st.none(), st.integers()),
})


@settings(max_examples=300, deadline=None)
@given(_entry)
def test_any_listing_entry_is_an_object_or_skipped(item: dict[str, Any]) -> None:
    """Whatever a listing entry holds, it becomes an object directly under the prefix with a
    size and an ETag, or it is skipped; it never raises."""
    loc = parse_uri("s3://bkt/m")
    info = S3Objects(Settings())._object_info(loc, "m/", item)
    if info is not None:
        assert info.uri == f"s3://bkt/m/{info.name}" and info.name and "/" not in info.name
        assert isinstance(info.size, int) and info.size >= 0 and isinstance(info.tag, str)


def test_bad_endpoint_setting_names_it() -> None:
    """s3_endpoint_url must be http(s)://host[:port]; anything else is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"s3_endpoint_url='minio:9000': give http\(s\)://host"):
        Settings(s3_endpoint_url="minio:9000")
    assert Settings(s3_endpoint_url="https://acc.r2.cloudflarestorage.com").s3_endpoint_url


# -- listing, checksums, identity --------------------------------------------------------


def test_listing_gives_direct_objects_with_sizes_and_etags(
    s3: LocalS3, client: Any, bucket: str, cache_dir: str
) -> None:
    """A listing has the objects directly under the prefix, with size and ETag, sorted."""
    put(client, bucket, "m/b.bin", b"0123456789")
    put(client, bucket, "m/a.json", b"{}")
    put(client, bucket, "m/sub/deeper.bin", b"x")
    put(client, bucket, "other/c.bin", b"y")
    infos = _store("", cache_dir).list_dir(f"s3://{bucket}/m")
    assert [(i.name, i.size, i.crc32c) for i in infos] == [("a.json", 2, None), ("b.bin", 10, None)]
    assert all(i.uri == f"s3://{bucket}/m/{i.name}" and i.tag.startswith('"') for i in infos)


@pytest.mark.timeout(180)
def test_listing_follows_pages(client: Any, bucket: str, cache_dir: str) -> None:
    """A prefix of more than one page (1000 keys) lists every object."""
    for i in range(1003):
        client.put_object(Bucket=bucket, Key=f"m/f{i:04d}", Body=b"")
    assert len(_store("", cache_dir).list_dir(f"s3://{bucket}/m")) == 1003


def test_same_bytes_give_one_version_on_disk_gcs_and_s3(
    gcs: LocalGCS, s3: LocalS3, client: Any, bucket: str, ckpt: Path, cache_dir: str
) -> None:
    """Local files, the GCS emulator and S3 (CRC32C in metadata, absent, composite) give one version."""
    upload_dir(client, bucket, "with", ckpt)
    upload_dir(client, bucket, "without", ckpt, crc32c=False)
    for f in sorted(os.listdir(ckpt)):
        data = (ckpt / f).read_bytes()
        if f.endswith(".safetensors"):  # one part: a multipart ETag, a composite checksum
            put_multipart(client, bucket, f"multi/{f}", data, "COMPOSITE")
        else:
            put(client, bucket, f"multi/{f}", data)
    gbucket = gcs.client().create_bucket("g" + uuid.uuid4().hex[:12])
    for f in sorted(os.listdir(ckpt)):
        gbucket.blob(f"deep/m/{f}").upload_from_filename(str(ckpt / f))
    local = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    store = _store("", cache_dir)
    specs = [ModelSpec.from_dir(f"s3://{bucket}/{p}", storage=store) for p in ("with", "without", "multi")]
    specs.append(ModelSpec.from_dir(f"gs://{gbucket.name}/deep/m", cache_dir=cache_dir))
    assert {s.version for s in specs} == {local.version}
    assert [s.name for s in specs[0].shards] == [s.name for s in local.shards]


def test_metadata_crc32c_reads_no_shard_bytes_and_is_cached(
    s3: LocalS3, client: Any, bucket: str, ckpt: Path, proxy: FaultProxy, cache_dir: str
) -> None:
    """With CRC32C in metadata a spec sends one HEAD per shard and GETs no shard byte; a
    second spec (a restart: new Storage, same cache) sends no HEAD either."""
    upload_dir(client, bucket, "m", ckpt)
    first = ModelSpec.from_dir(f"s3://{bucket}/m", storage=_store(proxy.host, cache_dir))
    assert len(_heads(proxy)) == 3 and _shard_gets(proxy) == []
    assert first.version == ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir).version
    proxy.requests.clear()
    again = ModelSpec.from_dir(f"s3://{bucket}/m", storage=_store(proxy.host, cache_dir))
    assert again.version == first.version
    assert _heads(proxy) == [] and _shard_gets(proxy) == []


def test_absent_crc32c_is_computed_once_then_cached(
    s3: LocalS3, client: Any, bucket: str, ckpt: Path, proxy: FaultProxy, cache_dir: str
) -> None:
    """Without CRC32C in metadata each shard is read once (ranged, pinned by If-Match) for
    it; a restart with the same cache reads none and asks for no metadata."""
    upload_dir(client, bucket, "m", ckpt, crc32c=False)
    pinned: list[str] = []
    proxy.before = lambda m, p, h: pinned.append(p) if h.get("If-Match") else None
    store = _store(proxy.host, cache_dir, chunk_bytes=1 << 20)
    first = ModelSpec.from_dir(f"s3://{bucket}/m", storage=store)
    local = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir + "-local")
    assert [s.crc32c for s in first.shards] == [s.crc32c for s in local.shards]
    gets = _shard_gets(proxy)
    assert len(gets) == 3 and sorted(gets) == sorted(pinned)
    proxy.requests.clear()
    again = ModelSpec.from_dir(f"s3://{bucket}/m", storage=_store(proxy.host, cache_dir))
    assert again.version == first.version == local.version
    assert _heads(proxy) == [] and _shard_gets(proxy) == []


def test_composite_checksum_is_not_taken_for_the_objects(
    s3: LocalS3, client: Any, bucket: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A multipart object's composite CRC32C is ignored (its CRC32C is computed, in
    parallel ranges); a full-object one is used as it is."""
    data = np.random.default_rng(1).integers(0, 256, (12 << 20) + 5, dtype=np.uint8).tobytes()
    put_multipart(client, bucket, "m/composite.bin", data, "COMPOSITE")
    put_multipart(client, bucket, "m/full.bin", data, "FULL_OBJECT")
    store = _store(proxy.host, cache_dir, chunk_bytes=4 << 20, storage_workers=4)
    infos = store.list_dir(f"s3://{bucket}/m")
    assert store.crc32cs(infos) == [f"{google_crc32c.value(data):08x}"] * 2
    got = proxy.media_requests()
    assert len(got) == 4 and all("composite.bin" in p for p in got)  # 13 MiB in 4 MiB ranges


def test_object_rewritten_after_listing_is_refused(
    s3: LocalS3, client: Any, bucket: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """An object rewritten between listing and its checksum, or while it is read for one,
    is a StorageError saying so; never a CRC32C of other bytes."""
    put(client, bucket, "m/a.bin", b"a" * 1000)
    put(client, bucket, "m/b.bin", b"b" * 3000, crc32c=False)
    store = _store(proxy.host, cache_dir)
    a, b = store.list_dir(f"s3://{bucket}/m")
    put(client, bucket, "m/a.bin", b"A" * 1000)
    with pytest.raises(StorageError, match=r"a\.bin changed after it was listed"):
        store.crc32cs([a])

    def rewrite(method: str, path: str, headers: Any) -> None:
        if headers.get("If-Match"):  # the checksum read has started: change the object
            put(client, bucket, "m/b.bin", b"B" * 3000, crc32c=False)

    proxy.before = rewrite
    with pytest.raises(StorageError, match=r"b\.bin \[0, 3000\) for its CRC32C: the object was"
                       r" rewritten while it was read; retry"):
        store.crc32cs([b])
    assert not Path(cache_dir, "crc32c-v1.json").exists()  # nothing wrong was cached


def test_object_corrupted_after_its_spec_is_a_checksum_mismatch(
    s3: LocalS3, client: Any, bucket: str, ckpt: Path, cache_dir: str
) -> None:
    """A shard rewritten (same size) after its spec was made fails every download with
    ChecksumMismatchError, and a new spec of the prefix has another version."""
    upload_dir(client, bucket, "m", ckpt)
    store = _store("", cache_dir, storage_attempts=2)
    spec = ModelSpec.from_dir(f"s3://{bucket}/m", storage=store)
    shard = spec.shards[0]
    data = bytearray((ckpt / shard.name).read_bytes())
    data[-1] ^= 0xFF
    put(client, bucket, f"m/{shard.name}", bytes(data))
    with pytest.raises(ChecksumMismatchError, match=rf"{shard.name}: CRC32C differs .* after 2 downloads"):
        store.download(shard)
    assert ModelSpec.from_dir(f"s3://{bucket}/m", storage=store).version != spec.version


# -- downloads ---------------------------------------------------------------------------


def test_download_in_parallel_ranges_exact_bytes(
    s3: LocalS3, client: Any, bucket: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A shard larger than chunk_bytes arrives intact as ranged GETs, one per chunk."""
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    put(client, bucket, "x/data.bin", data)
    shard = Shard(f"s3://{bucket}/x/data.bin", f"{google_crc32c.value(data):08x}", len(data))
    buf = _store(proxy.host, cache_dir, chunk_bytes=16_384).download(shard)
    assert buf.tobytes() == data
    assert len(proxy.media_requests()) == 7


def test_503s_are_retried_and_persistent_ones_give_up(
    s3: LocalS3, client: Any, bucket: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A few 503s are retried to the exact bytes; 503s on every attempt are a StorageError
    after storage_attempts, naming the range, the endpoint and the fix."""
    data = b"weights" * 1000
    put(client, bucket, "x/data.bin", data)
    shard = Shard(f"s3://{bucket}/x/data.bin", f"{google_crc32c.value(data):08x}", len(data))
    proxy.fail = 3
    assert _store(proxy.host, cache_dir, storage_attempts=5).download(shard).tobytes() == data
    assert len(proxy.media_requests()) == 4
    proxy.fail = 1000
    with pytest.raises(StorageError, match=r"downloading s3://.*data\.bin \[0, 7000\): failed"
                       r" after 3 attempts"):
        _store(proxy.host, cache_dir, storage_attempts=3).download(shard)


def test_corruption_in_transit_is_retried_then_refused(
    s3: LocalS3, client: Any, bucket: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A flipped byte once is downloaded again; on every download it is ChecksumMismatchError."""
    data = b"weights" * 1000
    put(client, bucket, "x/data.bin", data)
    shard = Shard(f"s3://{bucket}/x/data.bin", f"{google_crc32c.value(data):08x}", len(data))
    proxy.corrupt = 1
    assert _store(proxy.host, cache_dir).download(shard).tobytes() == data
    assert len(proxy.media_requests()) == 2
    proxy.corrupt = 1000
    with pytest.raises(ChecksumMismatchError, match=r"data\.bin: CRC32C differs .* after 3 downloads"):
        _store(proxy.host, cache_dir, storage_attempts=3).download(shard)


def test_server_ignoring_range_is_refused(
    s3: LocalS3, client: Any, bucket: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A server that answers ranged GETs with the whole object is a StorageError saying so,
    at once, never bytes at the wrong offset."""
    data = np.random.default_rng(2).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    put(client, bucket, "x/data.bin", data)
    shard = Shard(f"s3://{bucket}/x/data.bin", f"{google_crc32c.value(data):08x}", len(data))
    proxy.before = lambda m, p, h: h.__delitem__("Range")
    with pytest.raises(StorageError, match=r"downloading s3://.*data\.bin \[\d+, \d+\): the server"
                       r" (sent more than the 16384 bytes requested|answered Range bytes=)"):
        _store(proxy.host, cache_dir, chunk_bytes=16_384, storage_workers=1).download(shard)


def test_stalled_server_times_out(
    s3: LocalS3, client: Any, bucket: str, proxy: FaultProxy, cache_dir: str
) -> None:
    """A server that stops answering costs each attempt its read timeout, then a StorageError."""
    import time

    put(client, bucket, "x/data.bin", b"w" * 100)
    shard = Shard(f"s3://{bucket}/x/data.bin", f"{google_crc32c.value(b'w' * 100):08x}", 100)
    proxy.before = lambda m, p, h: time.sleep(5) if m == "GET" else None
    store = Storage(Settings(s3_endpoint_url=proxy.host, cache_dir=cache_dir, storage_attempts=2),
                    timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"data\.bin \[0, 100\): failed after 2 attempts"):
        store.download(shard)
    assert time.monotonic() - t0 < 4  # two 0.5 s timeouts, not the server's 5 s stall


def test_load_through_faults_gives_exact_weights(
    s3: LocalS3, client: Any, bucket: str, tmp_path: Path, proxy: FaultProxy, cache_dir: str
) -> None:
    """A storage load from s3:// through 503s and a corrupted chunk yields the exact weights."""
    model = fill_random(TinyTransformer(), 3)
    upload_dir(client, bucket, "m", write_checkpoint(model, tmp_path / "c", n_shards=2))
    store = _store(proxy.host, cache_dir, chunk_bytes=8192)
    spec = ModelSpec.from_dir(f"s3://{bucket}/m", storage=store)
    proxy.fail, proxy.corrupt, proxy.corrupt_from = 2, 1, 1  # header reads start at 0
    skeleton = build(TinyTransformer)
    result = load_from_storage(skeleton, spec, storage=store)
    expected, _ = named_tensors(model)
    got, _ = named_tensors(skeleton)
    assert all(_raw(expected[n]) == _raw(got[n]) for n in expected)
    assert result.source == "storage" and (proxy.fail, proxy.corrupt) == (0, 0)


# -- errors a user sees ------------------------------------------------------------------


def test_missing_bucket_is_one_line_naming_it(s3: LocalS3, cache_dir: str) -> None:
    """A bucket that does not exist: ShardNotFoundError naming the URI, the endpoint and the fix."""
    with pytest.raises(ShardNotFoundError) as e:
        ModelSpec.from_dir("s3://no-such-bucket/m", storage=_store("", cache_dir))
    text = str(e.value)
    assert "\n" not in text
    assert "checkpoint 's3://no-such-bucket/m' not found" in text
    assert f"bucket 'no-such-bucket' does not exist at {s3.endpoint}; check the name" in text
    assert "AWS_ENDPOINT_URL_S3" in text


def test_missing_object_and_prefix_name_them(client: Any, bucket: str, cache_dir: str) -> None:
    """A missing object or an empty prefix is a ShardNotFoundError naming what is missing."""
    store = _store("", cache_dir)
    with pytest.raises(ShardNotFoundError, match=rf"s3://{bucket}/x/gone\.safetensors .*: not found"):
        store.download(Shard(f"s3://{bucket}/x/gone.safetensors", "00000000", 10))
    with pytest.raises(ShardNotFoundError, match=rf"'s3://{bucket}/empty/config\.json' does not exist"):
        ModelSpec.from_dir(f"s3://{bucket}/empty", storage=store)


def test_no_credentials_says_how_to_give_them(
    s3: LocalS3, bucket: str, cache_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without any AWS credentials the read fails at once naming the URI and the fix."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StorageError, match=rf"listing s3://{bucket}/m: no usable AWS credentials"
                       r".*AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE"):
        ModelSpec.from_dir(f"s3://{bucket}/m", storage=_store("", cache_dir))


def test_setting_wins_over_the_environment_and_unreachable_is_clear(
    s3: LocalS3, cache_dir: str
) -> None:
    """s3_endpoint_url overrides AWS_ENDPOINT_URL_S3; an endpoint that does not answer HTTP is a
    StorageError after storage_attempts naming it."""
    from nccl_back.dev.servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    store = _store(dead, cache_dir, storage_attempts=2)
    with pytest.raises(StorageError, match=rf"listing s3://bkt/m: failed after 2 attempts: .*"
                       rf"\(endpoint {dead}; set AWS_ENDPOINT_URL_S3"):
        store.list_dir("s3://bkt/m")
    assert isinstance(store.backend(parse_uri("s3://bkt/m")), S3Objects)


# -- the peer path and the check ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_worker_from_s3_serves_worker_from_gcs(
    gcs: LocalGCS, s3: LocalS3, client: Any, bucket: str, ckpt: Path,
    redis_url: str, namespace: str, cache_dir: str,
) -> None:
    """A worker that loaded from s3:// serves one reading gs://: same version, peer load, exact bytes."""
    upload_dir(client, bucket, "m", ckpt, crc32c=False)
    gbucket = gcs.client().create_bucket("g" + uuid.uuid4().hex[:12])
    for f in sorted(os.listdir(ckpt)):
        gbucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
    config = Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                      cache_dir=cache_dir, peer_ttl=3.0,
                      transfer_timeout=20.0, handshake_timeout=5.0)
    from_s3 = ModelSpec.from_dir(f"s3://{bucket}/m", settings=config)
    from_gs = ModelSpec.from_dir(f"gs://{gbucket.name}/m", settings=config)
    assert from_s3.version == from_gs.version
    expected, _ = named_tensors(fill_random(TinyTransformer(), 4))
    with WeightService(config) as seed:
        first = seed.load(build(TinyTransformer), from_s3)
        assert (first.source, first.verified) == ("storage", True)
        with WeightService(config) as receiver:
            model = build(TinyTransformer)
            second = receiver.load(model, from_gs)
    assert (second.source, second.fallback_reason, second.verified) == ("peer", None, True)
    got, _ = named_tensors(model)
    assert sorted(got) == sorted(expected)
    assert all(_raw(expected[n]) == _raw(got[n]) for n in expected)


def _check(env: dict[str, str], uri: str) -> dict[str, Any]:
    from nccl_back.dev.servers import free_port

    proc = subprocess.run(
        [sys.executable, "-m", "nccl_back.cli", "check", "--model", uri, "--json",
         "--skip", "transports,redis,namespace", "--health-port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=100,
    )
    report = json.loads(proc.stdout)
    return next(c for c in report["checks"] if c["name"] == "storage")


@pytest.mark.timeout(200)
def test_check_probes_s3(s3: LocalS3, client: Any, bucket: str, ckpt: Path, tmp_path: Path) -> None:
    """`nccl-back check --model s3://...` reads the spec and a shard's first bytes, naming the
    endpoint and where the credentials came from; a missing bucket fails naming it."""
    upload_dir(client, bucket, "m", ckpt)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}, **s3.env,
           "NCCL_BACK_CACHE_DIR": str(tmp_path / "cache"), "NCCL_BACK_ADVERTISE_HOST": "127.0.0.1"}
    good = _check(env, f"s3://{bucket}/m")
    version = ModelSpec.from_dir(str(ckpt), cache_dir=str(tmp_path / "c2")).version
    assert good["status"] == "ok", good
    assert f"(endpoint {s3.endpoint}, region us-east-1, credentials from env)" in good["detail"]
    assert f"version {version}, 3 shard(s)" in good["detail"]
    bad = _check(env, "s3://no-such-bucket/m")
    assert bad["status"] == "fail"
    assert "bucket 'no-such-bucket' does not exist" in bad["detail"]
    assert "s3://bucket/prefix" in bad["fix"]
