"""What the ``s3://`` and ``az://`` backends share: object stores whose listing has no
CRC32C, read through streamed ranged GETs.

An object's CRC32C is asked of its metadata where the store may keep one
(:meth:`ObjectStore._metadata_crc32cs`), else computed once from ranged GETs pinned to
its listed ETag (an object replaced mid-read is an error, never a checksum of mixed
bytes), and cached by (scheme, endpoint, ETag, size) in ``cache_dir``: a restart sends
no request per object.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from nccl_back.errors import StorageError
from nccl_back.log import get_logger
from nccl_back.model.crc_cache import CrcCache, ranged_crc32cs
from nccl_back.model.storage import (
    MIN_CHUNK_BYTES,
    Backend,
    Location,
    ObjectInfo,
    too_large,
    with_retries,
)

log = get_logger("nccl_back.model.storage")

T = TypeVar("T")

#: Pages a listing may take (a prefix holds one model's files).
MAX_LIST_PAGES = 1000


class BufferWriter:
    """A write-only file object over a pre-allocated buffer (a download's chunk)."""

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


def range_total(what: str, start: int, content_range: Any) -> int | None:
    """The object's size from ``Content-Range: bytes a-b/TOTAL`` (None if it gives none),
    after checking that the answer starts at ``start``."""
    if start and not (isinstance(content_range, str) and content_range.startswith(f"bytes {start}-")):
        # A server that ignores Range sends the object from its first byte.
        raise StorageError(f"{what}: the server answered Range bytes={start}-... with"
                           f" {content_range!r}; use an endpoint that supports ranged GETs")
    if not isinstance(content_range, str):
        return None
    total = content_range.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def check_size(uri: str, what: str, total: int | None, most: int | None) -> None:
    """Refuse an object whose size, from a response's headers, is unknown or over ``most``
    (no bound when None), before a byte of its body is read."""
    if most is not None and (total is None or total > most):
        if total is None:
            raise StorageError(f"{what}: the server gave no size for the object")
        raise too_large(uri, total, most)


@dataclass(frozen=True)
class Body:
    """A GET's answer, its body unread: ``Content-Range`` (None: absent), the body's length
    where the server sent the whole object instead, its chunks, and how to drop it."""

    content_range: str | None
    whole: int | None
    chunks: Iterator[bytes]
    close: Callable[[], object]


class ObjectStore(Backend):
    """A remote store read by streamed ranged GETs (:meth:`_get`), each request through
    :meth:`_call`, and listed page by page (:meth:`_pages`)."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where the store is (part of every cached CRC32C's key)."""

    #: Whether a failed request is worth retrying.
    transient: Callable[[BaseException], bool]
    #: How to point the client at another endpoint (ends the message of spent retries).
    endpoint_fix: str

    @abc.abstractmethod
    def _known(self, what: str, loc: Location, e: BaseException) -> StorageError | None:
        """The failure ``e`` of a request on ``what`` in the store's words (a missing
        object, refused credentials), naming the fix; None for one it has no words for."""

    def _call(self, what: str, loc: Location, fn: Callable[[], T]) -> T:
        """``fn()`` with retries; failures mapped to one line naming the URI and the fix."""
        return with_retries(self.settings, what, fn, self.transient,
                            known=lambda e: self._known(what, loc, e),
                            hint=f" (endpoint {self.endpoint}; {self.endpoint_fix})")

    def _get(self, loc: Location, start: int, n: int, what: str, sink: Callable[[bytes], object],
             *, etag: str = "", most: int | None = None) -> tuple[int, int | None]:
        """One GET of bytes ``[start, start + n)`` streamed into ``sink``, ``If-Match:
        etag`` when given; (bytes received, the object's size where the response gives
        it). ``most`` bounds that size (:func:`check_size`) before a byte of the body is
        read; a body longer than asked is refused, never held."""
        got = self._open(loc, start, n, etag)
        try:
            total = range_total(what, start, got.content_range)
            total = got.whole if total is None and got.content_range is None else total
            check_size(loc.uri, what, total, most)
            size = 0
            for chunk in got.chunks:
                size += len(chunk)
                if size > n:
                    raise StorageError(f"{what}: the server sent more than the {n} bytes requested")
                sink(chunk)
            return size, total
        finally:
            got.close()  # unread bytes are dropped with the connection, not drained

    @abc.abstractmethod
    def _open(self, loc: Location, start: int, n: int, etag: str) -> Body:
        """The response to a GET of bytes ``[start, start + n)`` (``If-Match: etag`` when
        given), its body not yet read: read in chunks of at most one byte past ``n``."""

    @abc.abstractmethod
    def _pages(self, loc: Location, prefix: str) -> Iterable[Iterable[Any]]:
        """The raw entries under ``prefix`` (no deeper), page by page."""

    @abc.abstractmethod
    def _object_info(self, loc: Location, prefix: str, item: Any) -> ObjectInfo | None:
        """A raw listing entry as an object (:meth:`_listed`), or None."""

    @abc.abstractmethod
    def _past_end(self, e: BaseException | None) -> bool:
        """Whether a ranged read failed with ``e`` because it starts past the object's end."""

    def _metadata_crc32cs(self, infos: Sequence[ObjectInfo]) -> list[str | None]:
        """Each object's whole-object CRC32C from its metadata; None where it has none."""
        return [None] * len(infos)

    def _listed(self, loc: Location, prefix: str, name: Any, size: Any, tag: Any) -> ObjectInfo | None:
        """A listed object, or None for an entry that is not one directly inside
        ``prefix`` (anything malformed is logged)."""
        if not (isinstance(name, str) and name.startswith(prefix) and name != prefix
                and "/" not in name[len(prefix):] and type(size) is int and size >= 0
                and isinstance(tag, str)):
            if name != prefix:
                log.warning(f"{self.scheme}_listing_entry_skipped", uri=loc.uri, name=repr(name)[:200])
            return None
        return ObjectInfo(f"{self.scheme}://{loc.bucket}/{name}", name[len(prefix):], size, None,
                          tag=tag)

    def list_dir(self, loc: Location) -> list[ObjectInfo]:
        prefix = f"{loc.path}/" if loc.path else ""

        def listing() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            for n, page in enumerate(self._pages(loc, prefix)):
                if n >= MAX_LIST_PAGES:
                    raise StorageError(f"listing {loc.uri}: over {MAX_LIST_PAGES} pages of objects;"
                                       " give the prefix of one model")
                found.extend(i for i in (self._object_info(loc, prefix, e) for e in page) if i)
            return found

        return self._call(f"listing {loc.uri}", loc, listing)

    def _loc(self, info: ObjectInfo) -> Location:
        bucket, _, name = info.uri.partition("://")[2].partition("/")
        return Location(self.scheme, bucket, name)

    def crc32cs(self, infos: Sequence[ObjectInfo], cache_dir: str) -> list[str]:
        cache = CrcCache(cache_dir)
        keys = [[self.scheme, self.endpoint, i.tag, i.size] if i.tag else None for i in infos]
        out = [cache.get_key(i.uri, k) if k else None for i, k in zip(infos, keys, strict=True)]
        todo = [j for j, crc in enumerate(out) if crc is None]
        heads = self._metadata_crc32cs([infos[j] for j in todo])
        # Objects with no whole-object checksum are read, all in one pool of ranges.
        bare = [j for j, crc in zip(todo, heads, strict=True) if crc is None]
        computed = dict(zip(bare, self._compute_crc32cs([infos[j] for j in bare]), strict=True))
        for j, crc in zip(todo, heads, strict=True):
            out[j] = crc = crc or computed[j]
            key = keys[j]
            if key is not None:
                cache.put_key(infos[j].uri, key, crc)
        cache.save()
        return [str(c) for c in out]

    def _compute_crc32cs(self, infos: Sequence[ObjectInfo]) -> list[str]:
        """Read each object once for its CRC32C, in ranged GETs pinned to its listed ETag."""
        return ranged_crc32cs(
            [(i.uri, i.size) for i in infos],
            lambda j, off, n, what, sink: self._get(self._loc(infos[j]), off, n, what, sink,
                                                    etag=infos[j].tag)[0],
            lambda j, what, fn: self._call(what, self._loc(infos[j]), fn),
            workers=self.settings.storage_workers, chunk_bytes=self.settings.chunk_bytes,
            min_chunk=MIN_CHUNK_BYTES, backend=self.scheme)

    def read_range(self, loc: Location, start: int, end: int) -> bytes:
        buf = np.empty(end - start, dtype=np.uint8)
        what = f"reading {loc.uri} [{start}, {end})"
        try:
            n = self._call(what, loc, lambda: self._get(loc, start, end - start, what,
                                                        BufferWriter(buf.data).write)[0])
        except StorageError as e:
            if self._past_end(e.__cause__):
                return b""  # starts past the end: the object is shorter
            raise
        return buf[:n].tobytes()

    def read_bytes(self, loc: Location, *, max_bytes: int) -> bytes:
        what = f"reading {loc.uri}"

        def bounded() -> bytes:
            parts: list[bytes] = []
            try:
                self._get(loc, 0, max_bytes + 1, what, parts.append, most=max_bytes)
            except Exception as e:
                if self._past_end(e):
                    return b""  # no byte 0: the object is empty
                raise
            return b"".join(parts)

        return self._call(what, loc, bounded)

    def fetch_into(self, loc: Location, view: memoryview, start: int) -> int:
        """One ranged GET of ``len(view)`` bytes at ``start`` into ``view``; bytes received."""
        what = f"downloading {loc.uri} [{start}, {start + len(view)})"
        return self._call(what, loc, lambda: self._get(loc, start, len(view), what,
                                                       BufferWriter(view).write)[0])
