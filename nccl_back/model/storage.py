"""Reading checkpoints from storage: local paths, ``file://`` and ``gs://bucket/prefix``.

Local files are read with positional reads; ``gs://`` objects with the real
``google-cloud-storage`` client (which itself honours ``STORAGE_EMULATOR_HOST`` and
then uses anonymous credentials). Every remote request has a timeout and is retried
with tenacity (exponential backoff with jitter) on 429, 5xx and connection errors; the
client's own retries are switched off so ours are the only ones and the wait can be
injected. A shard is downloaded as parallel ranged chunks into one pre-allocated
buffer, and its CRC32C is checked against the checksum it was identified by: a
mismatch re-downloads the shard, then raises :class:`ChecksumMismatchError`.
"""

from __future__ import annotations

import base64
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import google_crc32c
import numpy as np
import requests
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential
from tenacity.wait import wait_base

from nccl_back.config import Settings
from nccl_back.errors import ChecksumMismatchError, ConfigError, ShardNotFoundError, StorageError
from nccl_back.log import get_logger

log = get_logger("nccl_back.model.storage")

T = TypeVar("T")

#: Seconds one HTTP request to GCS may take (connect and each read).
DEFAULT_TIMEOUT = 60.0
#: Smallest ranged request a shard is cut into (smaller shards are one request).
MIN_CHUNK_BYTES = 1 << 20

# GCS bucket names: 3-222 characters of lowercase letters, digits, '-', '_' and '.'.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


@dataclass(frozen=True)
class Location:
    """A parsed storage address: a local absolute path, or a bucket and object name."""

    scheme: Literal["file", "gs"]
    bucket: str
    path: str

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def uri(self) -> str:
        """The canonical form: the absolute path for local files, ``gs://bucket/name``."""
        return self.path if self.is_local else f"gs://{self.bucket}/{self.path}"

    def join(self, name: str) -> Location:
        """The location of ``name`` inside this directory (or object prefix)."""
        if self.is_local:
            return Location("file", "", os.path.join(self.path, name))
        return Location("gs", self.bucket, f"{self.path}/{name}" if self.path else name)


def parse_uri(uri: str) -> Location:
    """Parse a local path, ``file:///abs/path`` or ``gs://bucket/name``.

    Raises :class:`ConfigError` naming the bad value and the accepted forms.
    """
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"storage URI {uri!r}: give a local path, file:///path or gs://bucket/prefix")
    if uri.startswith("gs://"):
        bucket, _, name = uri[len("gs://") :].partition("/")
        if not _BUCKET_RE.match(bucket):
            raise ConfigError(
                f"storage URI {uri!r}: bad bucket name {bucket!r}; use gs://bucket/prefix"
            )
        return Location("gs", bucket, name.strip("/"))
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise ConfigError(f"storage URI {uri!r}: file:// needs an absolute path (file:///dir)")
        return Location("file", "", os.path.abspath(path))
    if "://" in uri:
        raise ConfigError(
            f"storage URI {uri!r}: unsupported scheme; use a local path, file:///path or gs://bucket/prefix"
        )
    return Location("file", "", os.path.abspath(uri))


@dataclass(frozen=True)
class Shard:
    """One checkpoint file: its URI, CRC32C (8 lowercase hex digits) and size in bytes.

    ``name`` is the file's path *within the model* (``model-00001-of-00002.safetensors``,
    ``unet/diffusion_pytorch_model.safetensors``): what identifies it whatever directory
    or bucket holds the model. It defaults to the URI's last component.
    """

    uri: str
    crc32c: str
    size: int
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.uri.rstrip("/").rsplit("/", 1)[-1])


@dataclass(frozen=True)
class ObjectInfo:
    """A file or object found by :meth:`Storage.list_dir`; ``crc32c`` is None for local files."""

    uri: str
    name: str
    size: int
    crc32c: str | None


def crc32c_hex(data: Any) -> str:
    """CRC32C of a bytes-like object or numpy array, as 8 hex digits."""
    return f"{google_crc32c.value(data):08x}"


def crc32c_from_gcs(b64: str) -> str:
    """GCS metadata reports CRC32C as base64 of 4 big-endian bytes; return 8 hex digits."""
    return base64.b64decode(b64).hex()


def is_transient(e: BaseException) -> bool:
    """Whether a failed request is worth retrying: 429, 5xx, connection errors, timeouts."""
    from google.api_core import exceptions as gexc

    if isinstance(e, gexc.GoogleAPICallError):
        code = e.code or 0
        return code == 429 or code >= 500
    return isinstance(e, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError))


class _BufferWriter:
    """A write-only file object over a pre-allocated buffer, for ``download_to_file``."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def write(self, data: bytes) -> int:
        n = len(data)
        if self.pos + n > len(self.view):
            raise StorageError(f"server sent more than the {len(self.view)} bytes requested")
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n


class Storage:
    """Reads files and objects; one instance may be shared by threads.

    ``wait`` and ``sleep`` are tenacity's: pass ``wait_none()`` or a no-op ``sleep`` in
    tests so retry paths run without real waits. ``client`` is a
    ``google.cloud.storage.Client``, created on first ``gs://`` use when not given.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: Any = None,
        wait: wait_base | None = None,
        sleep: Callable[[float], None] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.settings = settings or Settings()
        self._client = client
        self.wait = wait or wait_random_exponential(multiplier=0.5, max=30)
        self.sleep = sleep
        self.timeout = timeout
        self._client_lock = threading.Lock()

    @property
    def client(self) -> Any:
        # Header reads run in threads; the lock makes the first ones share one client.
        with self._client_lock:
            if self._client is None:
                from google.auth.exceptions import DefaultCredentialsError
                from google.cloud import storage

                try:
                    self._client = storage.Client()
                except DefaultCredentialsError as e:
                    raise StorageError(
                        f"no Google Cloud credentials for gs:// ({e}); run `gcloud auth "
                        "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
                    ) from e
            return self._client

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one remote request with retries; map failures to nccl_back errors."""
        from google.api_core import exceptions as gexc

        kwargs: dict[str, Any] = {} if self.sleep is None else {"sleep": self.sleep}
        retrying = Retrying(
            stop=stop_after_attempt(self.settings.storage_attempts),
            wait=self.wait,
            retry=retry_if_exception(is_transient),
            reraise=True,
            before_sleep=lambda rs: log.warning(
                "storage_retry", what=what, attempt=rs.attempt_number,
                error=repr(rs.outcome.exception()) if rs.outcome else None,
            ),
            **kwargs,
        )
        try:
            return retrying(fn)
        except gexc.NotFound as e:
            raise ShardNotFoundError(f"{what}: not found") from e
        except StorageError:
            raise
        except Exception as e:
            if is_transient(e):
                raise StorageError(
                    f"{what}: failed after {self.settings.storage_attempts} attempts: {e}"
                ) from e
            raise StorageError(f"{what}: {e}") from e

    # -- listing and small reads -------------------------------------------------------

    def list_dir(self, uri: str) -> list[ObjectInfo]:
        """The files (objects) directly inside directory (prefix) ``uri``, sorted by name.

        For ``gs://`` one listing returns every object's size and CRC32C, so no byte is
        downloaded and no per-object metadata request is needed.
        """
        loc = parse_uri(uri)
        if loc.is_local:
            try:
                entries = [e for e in os.scandir(loc.path) if e.is_file()]
            except (FileNotFoundError, NotADirectoryError) as e:
                raise ShardNotFoundError(f"directory {loc.path!r} does not exist (or is not one)") from e
            except OSError as e:
                raise StorageError(f"listing {loc.path!r}: {e}") from e
            infos = [ObjectInfo(e.path, e.name, e.stat().st_size, None) for e in entries]
        else:
            prefix = f"{loc.path}/" if loc.path else ""

            def listing() -> list[ObjectInfo]:
                blobs = self.client.list_blobs(
                    loc.bucket, prefix=prefix, delimiter="/", timeout=self.timeout, retry=None
                )
                return [
                    ObjectInfo(
                        f"gs://{loc.bucket}/{b.name}",
                        b.name[len(prefix) :],
                        int(b.size or 0),
                        crc32c_from_gcs(b.crc32c) if b.crc32c else None,
                    )
                    for b in blobs
                    if b.name != prefix
                ]

            infos = self._call(f"listing {loc.uri}", listing)
        return sorted(infos, key=lambda i: i.name)

    def read_bytes(self, uri: str) -> bytes:
        """The whole content of a small file or object (config, index)."""
        loc = parse_uri(uri)
        if loc.is_local:
            try:
                with open(loc.path, "rb") as f:
                    return f.read()
            except FileNotFoundError as e:
                raise ShardNotFoundError(f"{loc.path!r} does not exist") from e
            except OSError as e:
                raise StorageError(f"reading {loc.path!r}: {e}") from e
        blob_name = loc.path
        return self._call(
            f"reading {loc.uri}",
            lambda: self.client.bucket(loc.bucket).blob(blob_name).download_as_bytes(
                timeout=self.timeout, retry=None
            ),
        )

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file or object (fewer only if the file is shorter)."""
        if end <= start:
            return b""
        loc = parse_uri(uri)
        if loc.is_local:
            try:
                fd = os.open(loc.path, os.O_RDONLY)
            except FileNotFoundError as e:
                raise ShardNotFoundError(f"{loc.path!r} does not exist") from e
            try:
                return os.pread(fd, end - start, start)
            finally:
                os.close(fd)
        buf = np.empty(end - start, dtype=np.uint8)
        n = self._fetch_into(loc, buf.data, start)
        return buf[:n].tobytes()

    # -- shard downloads ----------------------------------------------------------------

    def _fetch_into(self, loc: Location, view: memoryview, start: int) -> int:
        """One ranged GET of ``len(view)`` bytes at ``start`` into ``view``; bytes received."""

        def fetch() -> int:
            # A fresh Blob (no metadata loaded) so the request goes to the client's
            # endpoint, not to a mediaLink that may name another host.
            blob = self.client.bucket(loc.bucket).blob(loc.path)
            writer = _BufferWriter(view)
            blob.download_to_file(
                writer, start=start, end=start + len(view) - 1,
                checksum=None, retry=None, timeout=self.timeout,
            )
            return writer.pos

        return self._call(f"downloading {loc.uri} [{start}, {start + len(view)})", fetch)

    def chunk_for(self, shard: Shard) -> int:
        """Bytes per ranged request of ``shard``: at most ``chunk_bytes``, and small
        enough that the shard alone keeps every storage worker busy, down to
        :data:`MIN_CHUNK_BYTES`."""
        per_worker = -(-shard.size // max(self.settings.storage_workers, 1))
        return min(self.settings.chunk_bytes, max(per_worker, MIN_CHUNK_BYTES))

    def _start(
        self, shard: Shard, pool: ThreadPoolExecutor, on_bytes: Callable[[int], None] | None = None
    ) -> tuple[np.ndarray, list[Future[int]]]:
        loc = parse_uri(shard.uri)
        if loc.is_local:
            raise ConfigError(f"{shard.uri!r} is local; read it in place instead of downloading")
        buf = np.empty(shard.size, dtype=np.uint8)
        view = buf.data
        step = self.chunk_for(shard)
        def fetch(off: int) -> int:
            got = self._fetch_into(loc, view[off : off + step], off)
            if on_bytes is not None:
                on_bytes(got)
            return got

        return buf, [pool.submit(fetch, off) for off in range(0, shard.size, step)]

    def _finish(self, shard: Shard, buf: np.ndarray, futures: list[Future[int]]) -> bool:
        """Wait for a shard's chunks; True if it is complete and its CRC32C matches."""
        got = sum(f.result() for f in futures)
        if got != shard.size:
            raise StorageError(f"{shard.uri}: received {got} bytes, expected {shard.size}")
        actual = crc32c_hex(buf)
        if actual == shard.crc32c:
            return True
        log.warning("checksum_mismatch", uri=shard.uri, expected=shard.crc32c, actual=actual)
        return False

    def download_many(
        self, shards: Sequence[Shard], on_bytes: Callable[[int], None] | None = None
    ) -> Generator[tuple[Shard, np.ndarray], None, None]:
        """Download ``shards`` in parallel; yield each (in order) with its verified bytes.

        ``on_bytes(n)`` is called from the download threads as each chunk of ``n`` bytes
        arrives (for a progress bar).

        Shards complete in order: each is cut into enough ranged requests to keep every
        worker busy (:meth:`chunk_for`) and the pool takes requests first in, first out,
        so shard i's bytes come in before shard i+1's (what lets a streamed download,
        relay.py, forward early). Beyond two shards (the next one downloads while the
        caller copies the current one), more start only while fewer than
        ``storage_workers`` requests are outstanding, so memory stays near two shards.
        """
        workers = self.settings.storage_workers
        pool = ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-download")
        pending: deque[tuple[Shard, np.ndarray, list[Future[int]]]] = deque()
        todo = deque(shards)
        try:
            while todo or pending:
                while todo and (
                    len(pending) < 2
                    or sum(not f.done() for p in pending for f in p[2]) < workers
                ):
                    shard = todo.popleft()
                    pending.append((shard, *self._start(shard, pool, on_bytes)))
                shard, buf, futures = pending.popleft()
                attempt = 1
                while not self._finish(shard, buf, futures):
                    if attempt >= self.settings.storage_attempts:
                        raise ChecksumMismatchError(
                            f"{shard.uri}: CRC32C differs from {shard.crc32c} after {attempt} downloads"
                        )
                    attempt += 1
                    buf, futures = self._start(shard, pool, on_bytes)
                yield shard, buf
                del buf
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def download(self, shard: Shard) -> np.ndarray:
        """One shard's verified bytes (see :meth:`download_many`)."""
        downloads = self.download_many([shard])
        try:
            return next(downloads)[1]
        finally:
            downloads.close()
