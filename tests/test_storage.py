"""Storage: URI parsing, local reads, and gs:// downloads against the real GCS emulator.

Faults (503s, a flipped byte) come from a small real HTTP proxy in front of the
emulator; the real google-cloud-storage client talks to it through
STORAGE_EMULATOR_HOST. The S3 tests (tests/test_s3.py) put the same proxy in front of
the S3 server.
"""

from __future__ import annotations

import http.client
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

import google_crc32c
import numpy as np
import pytest
import torch
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs_storage

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.errors import (
    ChecksumMismatchError,
    ConfigError,
    ShardNotFoundError,
    StorageError,
)
from nccl_back.model.checkpoint import flat_skeleton
from nccl_back.model.gcs import GcsObjects, crc32c_from_gcs
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.skeleton import build, named_tensors
from nccl_back.model.storage import Shard, Storage, parse_uri

from models import TinyTransformer, fill_random, write_checkpoint


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


_HOP_BY_HOP = {"connection", "transfer-encoding", "keep-alive", "content-length"}


def gcs_media(method: str, path: str) -> bool:
    """A GCS request for an object's bytes (not metadata, not a listing)."""
    return "alt=media" in path


@dataclass
class FaultProxy:
    """A real HTTP proxy to a storage server that can answer 503 or flip a byte of media.

    ``media(method, path)`` says which requests read an object's bytes. ``fail``
    requests (of those matching ``fail_media_only``) get a 503; ``corrupt`` media
    downloads whose range starts at or after ``corrupt_from`` get their first byte
    flipped. ``before(method, path, headers)``, when set, runs before each request is
    forwarded. ``paths`` records every request, ``requests`` each one's method and path.
    """

    upstream: str
    fail: int = 0
    fail_media_only: bool = True
    corrupt: int = 0
    corrupt_from: int = 0
    media: Callable[[str, str], bool] = gcs_media
    before: Callable[[str, str, Any], None] | None = None
    paths: list[str] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def host(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def media_requests(self) -> list[str]:
        return [p for m, p in self.requests if self.media(m, p)]

    def _decide(self, method: str, path: str, range_header: str | None) -> tuple[bool, bool]:
        media = self.media(method, path)
        start = int(range_header.split("=")[1].split("-")[0]) if range_header else 0
        with self.lock:
            self.paths.append(path)
            self.requests.append((method, path))
            if self.fail and (media or not self.fail_media_only):
                self.fail -= 1
                return True, False
            if self.corrupt and media and start >= self.corrupt_from:
                self.corrupt -= 1
                return False, True
        return False, False

    def start(self) -> FaultProxy:
        proxy = self
        target = urlparse(self.upstream)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                # Azure sends its range as x-ms-range.
                fail, corrupt = proxy._decide(self.command, self.path,
                                              self.headers.get("Range") or self.headers.get("x-ms-range"))
                if proxy.before is not None:
                    proxy.before(self.command, self.path, self.headers)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = bytearray(resp.read())
                conn.close()
                if corrupt and data:
                    data[0] ^= 0xFF
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                # A HEAD answer has no body but the length of the one a GET would have.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # A client that gave up (a timeout test) leaves its handler nobody to answer.
        self.server.handle_error = lambda *args: None  # type: ignore[method-assign]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def client(self) -> Any:
        """A real GCS client whose requests go through this proxy."""
        old = os.environ.get("STORAGE_EMULATOR_HOST")
        os.environ["STORAGE_EMULATOR_HOST"] = self.host
        try:
            return gcs_storage.Client(project="test", credentials=AnonymousCredentials())
        finally:
            if old is None:
                os.environ.pop("STORAGE_EMULATOR_HOST", None)
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = old


@pytest.fixture
def proxy(gcs: LocalGCS) -> Iterator[FaultProxy]:
    p = FaultProxy(gcs.host).start()
    yield p
    p.stop()


@pytest.fixture
def bucket(gcs: LocalGCS) -> Any:
    """A fresh bucket in the emulator."""
    return gcs.client().create_bucket("b" + uuid.uuid4().hex[:12])


def _upload(bucket: Any, name: str, data: bytes) -> Shard:
    blob = bucket.blob(name)
    blob.upload_from_string(data)
    blob.reload()
    return Shard(f"gs://{bucket.name}/{name}", crc32c_from_gcs(blob.crc32c), len(data))


class _NoWaits(_clock.Clock):
    """Sleeps return at once, so retry paths take milliseconds."""

    def sleep(self, seconds: float) -> None:
        pass


@pytest.fixture(autouse=True)
def _instant_retries() -> Iterator[None]:
    with _clock.use(_NoWaits()):
        yield


def _fast(client: Any, **settings: Any) -> Storage:
    """Storage reading gs:// on a client (its retries don't wait: see ``_instant_retries``)."""
    config = Settings(**settings)
    return Storage(config, backends={"gs": GcsObjects(config, client=client)})


def test_parse_uri_forms() -> None:
    """Local paths, file:// and gs:// parse to canonical locations."""
    assert parse_uri("gs://my-bucket/a/b/").uri == "gs://my-bucket/a/b"
    assert parse_uri("file:///tmp/x").uri == "/tmp/x"
    assert parse_uri("rel/dir").uri == os.path.abspath("rel/dir")
    assert parse_uri("gs://my-bucket/a").join("c.json").uri == "gs://my-bucket/a/c.json"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("gs://", "bad bucket name ''"),
        ("gs://Bad_Bucket!/x", "bad bucket name 'Bad_Bucket!'"),
        ("abfs://bucket/x", "unsupported scheme"),
        ("file://relative", "needs an absolute path"),
    ],
)
def test_parse_uri_rejects_bad_uris(uri: str, message: str) -> None:
    """A bad URI raises ConfigError naming it and the accepted forms."""
    with pytest.raises(ConfigError, match=message):
        parse_uri(uri)


def test_local_missing_file_names_it(tmp_path: Any) -> None:
    """Reading a missing local file raises ShardNotFoundError naming the path."""
    with pytest.raises(ShardNotFoundError, match="nope.safetensors"):
        Storage().read_range(str(tmp_path / "nope.safetensors"), 0, 8)
    with pytest.raises(ShardNotFoundError, match="nope.json"):
        Storage().read_bytes(f"file://{tmp_path}/nope.json", max_bytes=16)


def test_local_reads_and_listing(tmp_path: Any) -> None:
    """Local files list with sizes (no CRC32C) and read whole or by byte range."""
    (tmp_path / "b.bin").write_bytes(b"0123456789")
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "sub").mkdir()
    store = Storage()
    infos = store.list_dir(str(tmp_path))
    assert [(i.name, i.size, i.crc32c) for i in infos] == [("a.json", 2, None), ("b.bin", 10, None)]
    assert store.read_range(str(tmp_path / "b.bin"), 3, 6) == b"345"
    assert store.read_bytes(str(tmp_path / "a.json"), max_bytes=2) == b"{}"
    with pytest.raises(ShardNotFoundError, match="b.bin' does not exist"):
        store.list_dir(str(tmp_path / "b.bin"))


@pytest.mark.timeout(30)
def test_download_in_ranged_chunks(gcs: LocalGCS, bucket: Any, proxy: FaultProxy) -> None:
    """A shard larger than chunk_bytes arrives intact via several ranged requests."""
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    shard = _upload(bucket, "x/data.bin", data)
    buf = _fast(proxy.client(), chunk_bytes=16_384).download(shard)
    assert buf.tobytes() == data
    assert len(proxy.media_requests()) == 7


@pytest.mark.timeout(30)
def test_503s_are_retried(gcs: LocalGCS, bucket: Any, proxy: FaultProxy) -> None:
    """Storage answering 503 a few times is retried until the download succeeds."""
    data = b"weights" * 1000
    shard = _upload(bucket, "x/data.bin", data)
    proxy.fail = 3
    buf = _fast(proxy.client(), storage_attempts=5).download(shard)
    assert buf.tobytes() == data
    assert len(proxy.media_requests()) == 4


@pytest.mark.timeout(30)
def test_persistent_503_gives_up(gcs: LocalGCS, bucket: Any, proxy: FaultProxy) -> None:
    """When every attempt gets a 503 the download fails with StorageError after storage_attempts."""
    shard = _upload(bucket, "x/data.bin", b"w" * 100)
    proxy.fail = 1000
    with pytest.raises(StorageError, match="failed after 3 attempts"):
        _fast(proxy.client(), storage_attempts=3).download(shard)
    assert len(proxy.media_requests()) == 3


@pytest.mark.timeout(30)
def test_corruption_is_retried(gcs: LocalGCS, bucket: Any, proxy: FaultProxy) -> None:
    """A shard corrupted once in transit fails its CRC32C check and is downloaded again."""
    data = b"weights" * 1000
    shard = _upload(bucket, "x/data.bin", data)
    proxy.corrupt = 1
    assert _fast(proxy.client()).download(shard).tobytes() == data
    assert len(proxy.media_requests()) == 2


@pytest.mark.timeout(30)
def test_persistent_corruption_raises(gcs: LocalGCS, bucket: Any, proxy: FaultProxy) -> None:
    """A shard whose every download has a flipped byte raises ChecksumMismatchError."""
    shard = _upload(bucket, "x/data.bin", b"weights" * 1000)
    proxy.corrupt = 1000
    with pytest.raises(ChecksumMismatchError, match=r"data\.bin: CRC32C differs .* after 3 downloads"):
        _fast(proxy.client(), storage_attempts=3).download(shard)


@pytest.mark.timeout(30)
def test_missing_object_names_it(gcs: LocalGCS, bucket: Any) -> None:
    """Downloading an object that does not exist raises ShardNotFoundError naming it."""
    shard = Shard(f"gs://{bucket.name}/x/gone.safetensors", "00000000", 10)
    with pytest.raises(ShardNotFoundError, match="gone.safetensors"):
        _fast(gcs.client()).download(shard)


@pytest.mark.timeout(30)
def test_missing_bucket_names_it(gcs: LocalGCS) -> None:
    """Fingerprinting a gs:// prefix in a bucket that does not exist raises ShardNotFoundError."""
    with pytest.raises(ShardNotFoundError, match="gs://no-such-bucket/m"):
        ModelSpec.from_dir("gs://no-such-bucket/m", storage=_fast(gcs.client()))


@pytest.mark.timeout(60)
def test_gs_fingerprint_downloads_no_shard_bytes(
    gcs: LocalGCS, bucket: Any, proxy: FaultProxy, tmp_path: Any, cache_dir: str
) -> None:
    """A gs:// fingerprint takes CRC32C from metadata: only config and index are downloaded."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=3)
    for f in sorted(os.listdir(ckpt)):
        bucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
    spec = ModelSpec.from_dir(f"gs://{bucket.name}/m", storage=_fast(proxy.client()))
    local = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    assert [s.crc32c for s in spec.shards] == [s.crc32c for s in local.shards]
    assert [s.size for s in spec.shards] == [s.size for s in local.shards]
    media = proxy.media_requests()
    assert len(media) == 2 and not any("safetensors?" in p for p in media)


@pytest.mark.timeout(60)
def test_gs_load_with_faults(gcs: LocalGCS, bucket: Any, proxy: FaultProxy, tmp_path: Any) -> None:
    """A load from gs:// through 503s and one corrupted chunk still yields the exact weights."""
    model = fill_random(TinyTransformer(), 3)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", n_shards=2)
    for f in sorted(os.listdir(ckpt)):
        bucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
    store = _fast(proxy.client(), chunk_bytes=8192)
    spec = ModelSpec.from_dir(f"gs://{bucket.name}/m", storage=store)
    # Corrupt a chunk after the first: header reads (at offset 0) carry no checksum.
    proxy.fail, proxy.corrupt, proxy.corrupt_from = 2, 1, 1
    skeleton = build(TinyTransformer)
    result = load_from_storage(skeleton, spec, storage=store)
    expected, _ = named_tensors(model)
    got, _ = named_tensors(skeleton)
    assert all(_raw(expected[n]) == _raw(got[n]) for n in expected)  # bytes: NaN-safe
    assert result.source == "storage" and result.bytes == sum(t.nbytes for t in expected.values())
    assert "download" in result.timings
    assert (proxy.fail, proxy.corrupt) == (0, 0)  # both faults were hit and survived


def test_crc32c_from_gcs_matches_google_crc32c() -> None:
    """GCS's base64 CRC32C converts to the same hex digits google_crc32c computes."""
    import base64

    data = b"hello weights"
    b64 = base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()
    assert crc32c_from_gcs(b64) == f"{google_crc32c.value(data):08x}"


@pytest.mark.timeout(60)
def test_gs_and_local_copy_share_version(
    gcs: LocalGCS, bucket: Any, tmp_path: Any, cache_dir: str
) -> None:
    """A checkpoint at a gs:// prefix and its local copy have the same version (content identity)."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)
    for f in sorted(os.listdir(ckpt)):
        bucket.blob(f"deep/prefix/m/{f}").upload_from_filename(str(ckpt / f))
    remote = ModelSpec.from_dir(f"gs://{bucket.name}/deep/prefix/m", storage=_fast(gcs.client()))
    local = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    assert remote.version == local.version
    assert [s.name for s in remote.shards] == [s.name for s in local.shards]


@pytest.mark.timeout(60)
def test_flat_skeleton_reads_with_the_given_settings(
    gcs: LocalGCS, bucket: Any, proxy: FaultProxy, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """from_dir and flat_skeleton read through Storage(settings): the user's storage_attempts apply."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt")
    for f in sorted(os.listdir(ckpt)):
        bucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.host)
    one_try = Settings(storage_attempts=1, cache_dir=str(tmp_path / "cache"))
    spec = ModelSpec.from_dir(f"gs://{bucket.name}/m", settings=one_try)
    proxy.fail = 1  # the header read gets a 503; one attempt means no retry
    with pytest.raises(StorageError, match="failed after 1 attempts"):
        flat_skeleton(spec, settings=one_try)
    proxy.fail = 1
    with pytest.raises(StorageError, match="failed after 1 attempts"):
        ModelSpec.from_dir(f"gs://{bucket.name}/m", settings=one_try)  # config.json read


def test_each_shard_alone_keeps_every_storage_worker_busy() -> None:
    """A shard is cut into one ranged request per storage worker (so shards complete in
    order, first in first out), never above chunk_bytes nor below 1 MiB."""
    store = Storage(Settings(storage_workers=8, chunk_bytes=64 << 20))
    shard = lambda size: Shard("gs://b/m/x.safetensors", "00000000", size)  # noqa: E731
    assert store.chunk_for(shard(8 << 20)) == 1 << 20  # 8 MiB: 8 requests
    assert store.chunk_for(shard(5 << 30)) == 64 << 20  # 5 GiB: capped at chunk_bytes
    assert store.chunk_for(shard(100 << 20)) == -(-(100 << 20) // 8)
    assert store.chunk_for(shard(1000)) == 1 << 20  # tiny: one request
    small = Storage(Settings(storage_workers=8, chunk_bytes=8192))
    assert small.chunk_for(shard(1 << 20)) == 8192  # an explicit small chunk still rules
