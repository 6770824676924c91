"""Reading checkpoints from storage: local paths, ``file://`` and ``gs://bucket/prefix``.

Each scheme has a :class:`Backend` (the reads) and its URI form, in one map,
:data:`SCHEMES`; :class:`Storage` picks the backend by a URI's scheme. Local files are
read with positional reads (:class:`LocalFiles`); ``gs://`` objects by
:class:`nccl_back.model.gcs.GcsObjects`, imported on first use, with timeouts and
retries. A remote shard is downloaded as parallel ranged chunks into one
pre-allocated buffer, and its CRC32C is checked against the checksum it was
identified by: a mismatch re-downloads the shard, then raises
:class:`ChecksumMismatchError`. Adding a scheme is a backend and an entry in the map.
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
from typing import Any, Protocol

import google_crc32c
import numpy as np
from tenacity import wait_random_exponential
from tenacity.wait import wait_base

from nccl_back.config import Settings
from nccl_back.errors import ChecksumMismatchError, ConfigError, ShardNotFoundError, StorageError
from nccl_back.log import get_logger

log = get_logger("nccl_back.model.storage")

#: Seconds one HTTP request to GCS may take (connect and each read).
DEFAULT_TIMEOUT = 60.0
#: Smallest ranged request a shard is cut into (smaller shards are one request).
MIN_CHUNK_BYTES = 1 << 20

# GCS bucket names: 3-222 characters of lowercase letters, digits, '-', '_' and '.'.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


@dataclass(frozen=True)
class Location:
    """A parsed storage address: a local absolute path, or a bucket and object name."""

    scheme: str
    """A key of :data:`SCHEMES`: ``file`` or ``gs``."""
    bucket: str
    path: str

    @property
    def is_local(self) -> bool:
        """A file on this machine: read in place, never downloaded."""
        return SCHEMES[self.scheme].local

    @property
    def uri(self) -> str:
        """The canonical form: the absolute path for local files, ``gs://bucket/name``."""
        return self.path if self.is_local else f"{self.scheme}://{self.bucket}/{self.path}"

    def join(self, name: str) -> Location:
        """The location of ``name`` inside this directory (or object prefix)."""
        if self.is_local:
            return Location(self.scheme, "", os.path.join(self.path, name))
        return Location(self.scheme, self.bucket, f"{self.path}/{name}" if self.path else name)


def _parse_file(uri: str, rest: str) -> Location:
    if not rest.startswith("/"):
        raise ConfigError(f"storage URI {uri!r}: file:// needs an absolute path (file:///dir)")
    return Location("file", "", os.path.abspath(rest))


def _parse_gs(uri: str, rest: str) -> Location:
    bucket, _, name = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"storage URI {uri!r}: bad bucket name {bucket!r}; use gs://bucket/prefix")
    return Location("gs", bucket, name.strip("/"))


def _forms() -> str:
    forms = ["a local path", *(s.form for s in SCHEMES.values())]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


def parse_uri(uri: str) -> Location:
    """Parse a local path, ``file:///abs/path`` or ``gs://bucket/name``.

    Raises :class:`ConfigError` naming the bad value and the accepted forms.
    """
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"storage URI {uri!r}: give {_forms()}")
    name, sep, rest = uri.partition("://")
    if not sep:
        return Location("file", "", os.path.abspath(uri))
    scheme = SCHEMES.get(name)
    if scheme is None:
        raise ConfigError(f"storage URI {uri!r}: unsupported scheme; use {_forms()}")
    return scheme.parse(uri, rest)


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


class Backend(Protocol):
    """The reads of one storage scheme; one instance may be shared by threads."""

    def list_dir(self, loc: Location) -> list[ObjectInfo]:
        """The files (objects) directly inside ``loc``, in any order."""
        ...

    def read_bytes(self, loc: Location) -> bytes:
        """The whole content of a small file or object."""
        ...

    def read_range(self, loc: Location, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, ``start < end`` (fewer only if the file is shorter)."""
        ...

    def fetch_into(self, loc: Location, view: memoryview, start: int) -> int:
        """Read ``len(view)`` bytes at ``start`` into ``view`` (a download's chunk); bytes read."""
        ...


class LocalFiles:
    """Files on this machine (:class:`Backend`): positional reads, no retries."""

    def list_dir(self, loc: Location) -> list[ObjectInfo]:
        try:
            entries = [e for e in os.scandir(loc.path) if e.is_file()]
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ShardNotFoundError(f"directory {loc.path!r} does not exist (or is not one)") from e
        except OSError as e:
            raise StorageError(f"listing {loc.path!r}: {e}") from e
        return [ObjectInfo(e.path, e.name, e.stat().st_size, None) for e in entries]

    def read_bytes(self, loc: Location) -> bytes:
        try:
            with open(loc.path, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise ShardNotFoundError(f"{loc.path!r} does not exist") from e
        except OSError as e:
            raise StorageError(f"reading {loc.path!r}: {e}") from e

    def read_range(self, loc: Location, start: int, end: int) -> bytes:
        try:
            fd = os.open(loc.path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise ShardNotFoundError(f"{loc.path!r} does not exist") from e
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def fetch_into(self, loc: Location, view: memoryview, start: int) -> int:
        raise ConfigError(f"{loc.uri!r} is local; read it in place instead of downloading")


def _gcs(storage: Storage) -> Backend:
    from nccl_back.model.gcs import GcsObjects  # the Google client: only once gs:// is read

    return GcsObjects(storage.settings, storage._client, storage.wait, storage.timeout)


@dataclass(frozen=True)
class Scheme:
    """One URI scheme: its form (for messages), its parser and its backend."""

    form: str
    local: bool
    """Files on this machine: read in place by the loader, never downloaded."""
    parse: Callable[[str, str], Location]
    """``(uri, the part after "scheme://") -> Location``; :class:`ConfigError` if malformed."""
    backend: Callable[[Storage], Backend]
    """Makes the scheme's backend for a :class:`Storage` (once, on its first use)."""


#: Every scheme a URI may have (a plain path is ``file``).
SCHEMES: dict[str, Scheme] = {
    "file": Scheme("file:///path", True, _parse_file, lambda storage: LocalFiles()),
    "gs": Scheme("gs://bucket/prefix", False, _parse_gs, _gcs),
}


class Storage:
    """Reads files and objects through the backend of each URI's scheme; one instance
    may be shared by threads.

    ``client`` is a ``google.cloud.storage.Client``, created on first ``gs://`` use when
    not given. The waits between a remote request's attempts sleep through
    :mod:`nccl_back._clock` (tests make them instant there).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.settings = settings or Settings()
        self._client = client
        self.wait: wait_base = wait_random_exponential(multiplier=0.5, max=30)
        self.timeout = timeout
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def backend(self, loc: Location) -> Backend:
        """The backend reading ``loc``'s scheme (made on first use, then shared)."""
        with self._lock:
            found = self._backends.get(loc.scheme)
            if found is None:
                found = self._backends[loc.scheme] = SCHEMES[loc.scheme].backend(self)
            return found

    def list_dir(self, uri: str) -> list[ObjectInfo]:
        """The files (objects) directly inside directory (prefix) ``uri``, sorted by name.

        For ``gs://`` one listing returns every object's size and CRC32C, so no byte is
        downloaded and no per-object metadata request is needed.
        """
        loc = parse_uri(uri)
        return sorted(self.backend(loc).list_dir(loc), key=lambda i: i.name)

    def read_bytes(self, uri: str) -> bytes:
        """The whole content of a small file or object (config, index)."""
        loc = parse_uri(uri)
        return self.backend(loc).read_bytes(loc)

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file or object (fewer only if the file is shorter)."""
        if end <= start:
            return b""
        loc = parse_uri(uri)
        return self.backend(loc).read_range(loc, start, end)

    # -- shard downloads ----------------------------------------------------------------

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
        backend = self.backend(loc)
        buf = np.empty(shard.size, dtype=np.uint8)
        view = buf.data
        step = self.chunk_for(shard)

        def fetch(off: int) -> int:
            got = backend.fetch_into(loc, view[off : off + step], off)
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
