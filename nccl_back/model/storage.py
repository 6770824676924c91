"""Reading checkpoints from storage, one :class:`Backend` per URI scheme.

Backends register by scheme (:func:`register_backend`); :data:`SCHEMES` names the module
registering each, imported on first use, so a worker reading local files never loads a
cloud client. A remote shard is downloaded as parallel ranged chunks into one buffer,
its CRC32C checked against the one it was identified by: a mismatch re-downloads it,
then :class:`ChecksumMismatchError`.
"""

from __future__ import annotations

import abc
import importlib
import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    ConfigError,
    ShardNotFoundError,
    StorageError,
)
from nccl_back.log import get_logger
from nccl_back.model.crc import crc32c_hex
from nccl_back.model.crc_cache import Opener, local_crc32cs, open_unbuffered
from nccl_back.timing import STORAGE_TIMEOUT as DEFAULT_TIMEOUT

log = get_logger("nccl_back.model.storage")

T = TypeVar("T")

#: Smallest ranged request a shard is cut into (smaller shards are one request).
MIN_CHUNK_BYTES = 1 << 20
#: Every scheme a URI may have (a plain path is ``file``) and the module registering its backend.
SCHEMES: dict[str, str] = {
    "file": __name__,
    "gs": "nccl_back.model.gcs",
    "s3": "nccl_back.model.s3",
    "az": "nccl_back.model.az",
}


@dataclass(frozen=True)
class Location:
    """A parsed storage address: a local absolute path, or a bucket and object name."""

    scheme: str
    """A key of :data:`SCHEMES`."""
    bucket: str
    path: str

    @property
    def is_local(self) -> bool:
        """A file on this machine: read in place, never downloaded."""
        return backend_class(self.scheme).local

    @property
    def uri(self) -> str:
        """The canonical form: the absolute path for local files, ``scheme://bucket/name``."""
        return self.path if self.is_local else f"{self.scheme}://{self.bucket}/{self.path}"

    def join(self, name: str) -> Location:
        """The location of ``name`` inside this directory (or object prefix)."""
        if self.is_local:
            return Location(self.scheme, "", os.path.join(self.path, name))
        return Location(self.scheme, self.bucket, f"{self.path}/{name}" if self.path else name)


def forms() -> str:
    """Every accepted URI form, for messages: ``a local path, file:///path, ... or ...``."""
    found = ["a local path", *(backend_class(s).form for s in SCHEMES)]
    return ", ".join(found[:-1]) + " or " + found[-1]


def parse_uri(uri: str) -> Location:
    """Parse a local path or ``scheme://...`` by its backend's rules; :class:`ConfigError`
    naming the bad value and the accepted forms."""
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"storage URI {uri!r}: give {forms()}")
    name, sep, rest = uri.partition("://")
    if not sep:
        return Location("file", "", os.path.abspath(uri))
    if name not in SCHEMES:
        raise ConfigError(f"storage URI {uri!r}: unsupported scheme; use {forms()}")
    return backend_class(name).parse(uri, rest)


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
    """A file or object found by :meth:`Storage.list_dir`.

    ``crc32c`` is set where the listing itself carries it (``gs://``), else None: ask
    :meth:`Storage.crc32cs`. ``tag`` is the object's version as its store reports it
    (an S3 ETag), "" where the backend has none.
    """

    uri: str
    name: str
    size: int
    crc32c: str | None
    tag: str = ""


class Backend(abc.ABC):
    """What one storage scheme implements, all of it; one instance may be shared by threads.

    Made by :class:`Storage` as ``cls(settings)`` on a scheme's first use. Requests to
    remote storage are bounded by ``timeout`` and retried through :func:`with_retries`;
    failures raise :class:`StorageError` (:class:`ShardNotFoundError` for what does not
    exist) in one line naming the URI and the fix.
    """

    scheme: ClassVar[str]
    """The URI scheme, a key of :data:`SCHEMES`."""
    form: ClassVar[str]
    """The URI form, for messages (``s3://bucket/prefix``)."""
    local: ClassVar[bool] = False
    """Files on this machine: read in place by the loader, never downloaded."""

    def __init__(self, settings: Settings, *, timeout: float = DEFAULT_TIMEOUT,
                 client: Any = None) -> None:
        self.settings = settings
        self.timeout = timeout
        self._client = client
        self._client_lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The client given, else :meth:`_make_client`'s, made once and shared by threads."""
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        """A client of the remote store (:class:`StorageError` naming the fix if none)."""
        raise StorageError(f"{self.scheme}:// has no client")

    @classmethod
    @abc.abstractmethod
    def parse(cls, uri: str, rest: str) -> Location:
        """``(uri, the part after "scheme://") -> Location``; :class:`ConfigError` naming
        the value if it breaks the scheme's rules."""

    @abc.abstractmethod
    def list_dir(self, loc: Location) -> list[ObjectInfo]:
        """The files (objects) directly inside ``loc``, in any order, with their sizes."""

    @abc.abstractmethod
    def crc32cs(self, infos: Sequence[ObjectInfo], cache_dir: str) -> list[str]:
        """Each listed object's CRC32C (8 hex digits), in order: from its metadata where
        it has a whole-object one, else computed once and cached in ``cache_dir``."""

    @abc.abstractmethod
    def read_bytes(self, loc: Location, *, max_bytes: int) -> bytes:
        """A small file's (config, index) whole content: over ``max_bytes`` by the size
        the store reports, refused (:func:`too_large`) before a byte of it is read; if it
        grows meanwhile, no more than ``max_bytes + 1`` bytes read."""

    @abc.abstractmethod
    def read_range(self, loc: Location, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, ``start < end`` (fewer only if the file is shorter)."""

    @abc.abstractmethod
    def fetch_into(self, loc: Location, view: memoryview, start: int) -> int:
        """Read ``len(view)`` bytes at ``start`` into ``view`` (a download's chunk); bytes read."""

    def describe(self) -> str:
        """Where this backend reads and as whom, for ``nccl-back check`` ("" if nothing to
        say, or if finding out fails: a description must never fail the check it decorates)."""
        try:
            return self._describe()
        except Exception:
            return ""

    def _describe(self) -> str:
        return ""


def too_large(uri: str, size: int, max_bytes: int) -> CheckpointFormatError:
    """The one refusal of a small file over its bound (:meth:`Backend.read_bytes`)."""
    return CheckpointFormatError(f"{uri}: {size} bytes, over the {max_bytes}-byte limit")


_REGISTRY: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Called by the module :data:`SCHEMES` names, at import: ``cls`` reads ``cls.scheme``."""
    if cls.scheme not in SCHEMES:
        raise ConfigError(f"storage scheme {cls.scheme!r} is not one of {sorted(SCHEMES)}")
    _REGISTRY[cls.scheme] = cls
    return cls


def backend_class(scheme: str) -> type[Backend]:
    """The backend registered for ``scheme``, importing its module on first use."""
    found = _REGISTRY.get(scheme)
    if found is None:
        if scheme not in SCHEMES:
            raise ConfigError(f"storage scheme {scheme!r}: choose one of {sorted(SCHEMES)}")
        importlib.import_module(SCHEMES[scheme])
        found = _REGISTRY[scheme]
    return found


def with_retries(
    settings: Settings, what: str, fn: Callable[[], T], transient: Callable[[BaseException], bool],
    *, known: Callable[[BaseException], StorageError | None] = lambda e: None, hint: str = "",
) -> T:
    """``fn()``, retried while it fails with a ``transient`` error, up to
    ``storage_attempts`` attempts with exponential backoff and jitter.

    Every failure is one :class:`StorageError` on ``what``: the one ``known`` maps the
    last error to (a missing object, refused credentials: the backend's words), else
    "failed after N attempts" (then ``hint``) for a transient one, else its own text.
    """
    retrying = Retrying(
        stop=stop_after_attempt(settings.storage_attempts),
        wait=wait_random_exponential(multiplier=0.5, max=30),
        retry=retry_if_exception(transient),
        reraise=True,
        before_sleep=lambda rs: log.warning(
            "storage_retry", what=what, attempt=rs.attempt_number,
            error=repr(rs.outcome.exception()) if rs.outcome else None,
        ),
        sleep=_clock.sleep,  # the one clock: a test that replaces it controls the waits
    )
    try:
        return retrying(fn)
    except StorageError:
        raise
    except Exception as e:
        mapped = known(e)
        if mapped is not None:
            raise mapped from e
        if transient(e):
            raise StorageError(f"{what}: failed after {settings.storage_attempts} attempts:"
                               f" {e}{hint}") from e
        raise StorageError(f"{what}: {e}") from e


class LocalFiles(Backend):
    """Files on this machine: positional reads, no retries; CRC32C through the cache of
    :mod:`~nccl_back.model.crc_cache` (``opener`` opens files for checksumming)."""

    scheme = "file"
    form = "file:///path"
    local = True

    def __init__(
        self, settings: Settings | None = None, *, timeout: float = DEFAULT_TIMEOUT,
        opener: Opener = open_unbuffered,
    ) -> None:
        super().__init__(settings or Settings(), timeout=timeout)
        self.opener = opener

    @classmethod
    def parse(cls, uri: str, rest: str) -> Location:
        if not rest.startswith("/"):
            raise ConfigError(f"storage URI {uri!r}: file:// needs an absolute path (file:///dir)")
        return Location("file", "", os.path.abspath(rest))

    def list_dir(self, loc: Location) -> list[ObjectInfo]:
        try:
            entries = [e for e in os.scandir(loc.path) if e.is_file()]
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ShardNotFoundError(f"directory {loc.path!r} does not exist (or is not one)") from e
        except OSError as e:
            raise StorageError(f"listing {loc.path!r}: {e}") from e
        return [ObjectInfo(e.path, e.name, e.stat().st_size, None) for e in entries]

    def crc32cs(self, infos: Sequence[ObjectInfo], cache_dir: str) -> list[str]:
        return local_crc32cs([i.uri for i in infos], cache_dir, self.opener)

    def read_bytes(self, loc: Location, *, max_bytes: int) -> bytes:
        try:
            with open(loc.path, "rb") as f:
                if (size := os.fstat(f.fileno()).st_size) > max_bytes:
                    raise too_large(loc.path, size, max_bytes)
                return f.read(max_bytes + 1)  # Storage.read_bytes refuses one that grew
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


register_backend(LocalFiles)


class Storage:
    """Reads files and objects through the backend of each URI's scheme; one instance
    may be shared by threads.

    ``backends`` gives ready backends by scheme (one on a client the caller made, local
    files with another opener); the others are made on first use with ``settings``.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        backends: Mapping[str, Backend] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.settings = settings or Settings()
        self.timeout = timeout
        self.given: dict[str, Backend] = dict(backends or {})
        for scheme, b in self.given.items():
            if b.scheme != scheme:
                raise ConfigError(f"backend {type(b).__name__} reads {b.scheme}://, not {scheme}://")
        self._backends: dict[str, Backend] = dict(self.given)
        self._lock = threading.Lock()

    def backend(self, loc: Location) -> Backend:
        """The backend reading ``loc``'s scheme (made on first use, then shared)."""
        with self._lock:
            found = self._backends.get(loc.scheme)
            if found is None:
                cls = backend_class(loc.scheme)
                found = self._backends[loc.scheme] = cls(self.settings, timeout=self.timeout)
            return found

    def list_dir(self, uri: str) -> list[ObjectInfo]:
        """The files (objects) directly inside directory (prefix) ``uri``, sorted by name."""
        loc = parse_uri(uri)
        return sorted(self.backend(loc).list_dir(loc), key=lambda i: i.name)

    def crc32cs(self, infos: Sequence[ObjectInfo], cache_dir: str | None = None) -> list[str]:
        """Each listed object's CRC32C, in order, from its scheme's backend (metadata, or
        computed once and cached in ``cache_dir``, else the settings' ``cache_dir``)."""
        cache = cache_dir or self.settings.cache_dir
        by_backend: dict[Backend, list[int]] = {}
        for i, info in enumerate(infos):
            by_backend.setdefault(self.backend(parse_uri(info.uri)), []).append(i)
        out: list[str] = [""] * len(infos)
        for backend, idx in by_backend.items():
            for i, crc in zip(idx, backend.crc32cs([infos[i] for i in idx], cache), strict=True):
                out[i] = crc
        return out

    def read_bytes(self, uri: str, *, max_bytes: int) -> bytes:
        """A small file's whole content (:meth:`Backend.read_bytes`)."""
        loc = parse_uri(uri)
        data = self.backend(loc).read_bytes(loc, max_bytes=max_bytes)
        if len(data) > max_bytes:  # grew after its size was taken
            raise too_large(loc.uri, len(data), max_bytes)
        return data

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
        """One shard's verified bytes (:meth:`download_many`)."""
        downloads = self.download_many([shard])
        try:
            return next(downloads)[1]
        finally:
            downloads.close()
