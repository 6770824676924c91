"""CRC32C of checkpoint files and objects, computed once and cached on disk.

A local file's CRC32C is streamed through one reused buffer and cached in
``<cache_dir>/crc32c-v1.json``, keyed by the file's identity (path, size, mtime, inode,
ctime), so a restart reads no shard bytes. A file modified less than 2 s before it is
checksummed is not cached: a same-size rewrite within the file system's timestamp
granularity would keep the same key ("racy git"). A missing or damaged cache only
costs a recomputation, and failing to write it never fails a load. The loader does not
consult the cache: it checksums the bytes it reads into the tensors.

The same cache holds remote objects' CRC32C by URI, under whatever identity key their
backend gives (an S3 object's endpoint, ETag and size: :mod:`nccl_back.model.s3`).
:func:`~nccl_back.model.crc.crc32c_combine` joins the CRC32C of consecutive pieces, so an object read as
parallel ranges is checksummed without holding it whole (:func:`ranged_crc32cs`, for
object stores that keep no CRC32C of their own).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import google_crc32c
import numpy as np

from nccl_back import bounded_json
from nccl_back.config import Settings
from nccl_back.errors import ShardNotFoundError, StorageError
from nccl_back.files import write_atomic
from nccl_back.log import get_logger
from nccl_back.model.crc import crc32c_combine

__all__ = ["CACHE_NAME", "CrcCache", "Opener", "file_crc32c", "local_crc32cs", "ranged_crc32cs"]

log = get_logger(__name__)

CACHE_NAME = "crc32c-v1.json"
#: Largest CRC cache parsed.
_MAX_CACHE_BYTES = 256 << 20
# Small enough to stay in CPU cache between the read and the checksum: measured
# 8-14 GB/s with 1 MiB against ~5 GB/s with 16 MiB.
_READ_BUFFER_BYTES = 1 << 20
#: Files modified less than this long before checksumming are not cached (see above).
_RACY_NS = 2_000_000_000

#: Opens a local file for checksumming (tests pass one that counts the reads).
Opener = Callable[[str], IO[bytes]]
_CRC_RE = re.compile(r"^[0-9a-f]{8}$")


def open_unbuffered(path: str) -> IO[bytes]:
    return open(path, "rb", buffering=0)


def _stream_crc32c(path: str, opener: Opener) -> str:
    buf = np.empty(_READ_BUFFER_BYTES, dtype=np.uint8)
    crc = 0
    with opener(path) as f:
        while n := f.readinto(buf):  # type: ignore[attr-defined]
            # A numpy view, not a memoryview: google_crc32c is several times slower on those.
            crc = google_crc32c.extend(crc, buf[:n])
    return f"{crc:08x}"


def _file_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


class CrcCache:
    """CRC32C by name (a local file's absolute path, an object's URI), each valid while
    the identity key stored with it is unchanged."""

    def __init__(self, cache_dir: str) -> None:
        self.path = Path(cache_dir) / CACHE_NAME
        self.dirty = False
        try:
            data = bounded_json.loads(self.path.read_bytes(), max_bytes=_MAX_CACHE_BYTES)
            self.entries: dict[str, Any] = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            # A missing or damaged cache only costs a recomputation.
            self.entries = {}

    def get_key(self, name: str, key: list[Any]) -> str | None:
        """The CRC32C cached for ``name`` under identity ``key``; None if absent or stale."""
        entry = self.entries.get(name)
        if isinstance(entry, dict) and entry.get("key") == key:
            crc = entry.get("crc32c")
            # The file is ours but may be damaged: a value that is no CRC is recomputed.
            return crc if isinstance(crc, str) and _CRC_RE.match(crc) else None
        return None

    def put_key(self, name: str, key: list[Any], crc: str) -> None:
        """Cache ``crc`` for ``name`` while its identity is ``key`` (JSON values)."""
        self.entries[name] = {"key": key, "crc32c": crc}
        self.dirty = True

    def save(self) -> None:
        """Write atomically (:func:`~nccl_back.files.write_atomic`): a concurrent reader
        sees the old or new file."""
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(self.entries, sort_keys=True))
            self.dirty = False
        except OSError as e:
            # The cache is an optimisation: failing to write it must not fail the load.
            log.warning("crc_cache_write_failed", path=str(self.path), error=str(e))


def file_crc32c(
    path: str, *, cache_dir: str | None = None, opener: Opener = open_unbuffered
) -> str:
    """CRC32C (8 hex digits) of a local file, from the cache in ``cache_dir`` when valid."""
    return local_crc32cs([os.path.abspath(path)], cache_dir, opener)[0]


def local_crc32cs(paths: list[str], cache_dir: str | None, opener: Opener) -> list[str]:
    """CRC32C of each local file of ``paths``, in order, through one cache load and save."""
    cache = CrcCache(cache_dir or Settings().cache_dir)
    # Threads overlap one file's read (GIL released) with another's checksum.
    workers = max(1, min(4, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-crc") as pool:
        crcs = list(pool.map(lambda p: _cached_file_crc32c(p, cache, opener), paths))
    cache.save()
    return crcs


def _cached_file_crc32c(path: str, cache: CrcCache, opener: Opener) -> str:
    """From ``cache`` while the file's identity is unchanged, else read (then cached
    when that is safe)."""
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"shard {path!r} does not exist") from e
    crc = cache.get_key(path, _file_key(st))
    if crc is None:
        # Real time, not nccl_back._clock: it is compared with the file system's mtime.
        started = time.time_ns()
        crc = _stream_crc32c(path, opener)
        # Cache only a file that was not rewritten while we read it, and whose mtime is
        # older than the file system's timestamp granularity ("racy git"): a same-size
        # rewrite within that window would keep the same key and reuse a stale CRC.
        if _file_key(os.stat(path)) == _file_key(st) and st.st_mtime_ns < started - _RACY_NS:
            cache.put_key(path, _file_key(st), crc)
        log.debug("crc32c_computed", path=path, size=st.st_size, crc32c=crc)
    return crc


#: ``read(j, offset, n, what, sink)``: feed bytes ``[offset, offset + n)`` of object ``j``
#: to ``sink``, returning how many came (the backend pins the object's listed version).
RangeRead = Callable[[int, int, int, str, Callable[[bytes], None]], int]
#: ``call(j, what, fn)``: ``fn()`` under the backend's retry policy for object ``j``.
RetryCall = Callable[[int, str, Callable[[], int]], int]


def ranged_crc32cs(objects: list[tuple[str, int]], read: RangeRead, call: RetryCall, *,
                   workers: int, chunk_bytes: int, min_chunk: int, backend: str) -> list[str]:
    """The CRC32C of each ``(uri, size)`` object, each read once in ranged pieces.

    The pieces of every object share one pool of ``workers`` (small objects do not wait
    on each other), each small enough that together they keep every worker busy; a
    piece is retried whole by ``call``, and a short one is an error (so retried). The
    pieces' CRC32C are joined by :func:`crc32c_combine`: no object is held whole."""
    per_worker = -(-sum(size for _, size in objects) // max(1, workers))
    step = min(chunk_bytes, max(per_worker, min_chunk))
    pieces = [(j, off) for j, (_, size) in enumerate(objects) for off in range(0, size, step)]

    def piece(p: tuple[int, int]) -> int:
        j, off = p
        uri, size = objects[j]
        n = min(step, size - off)
        what = f"reading {uri} [{off}, {off + n}) for its CRC32C"

        def fetch() -> int:
            crc = 0

            def extend(data: bytes) -> None:
                nonlocal crc
                crc = google_crc32c.extend(crc, data)

            got = read(j, off, n, what, extend)
            if got != n:
                raise StorageError(f"{what}: received {got} bytes, expected {n}")
            return crc

        return call(j, what, fetch)

    with ThreadPoolExecutor(max(1, min(workers, len(pieces))),
                            thread_name_prefix=f"nccl-back-{backend}-crc") as pool:
        crcs = list(pool.map(piece, pieces))
    totals = [0] * len(objects)
    for (j, off), crc in zip(pieces, crcs, strict=True):
        totals[j] = crc32c_combine(totals[j], crc, min(step, objects[j][1] - off))
    for (uri, size), total in zip(objects, totals, strict=True):
        log.info("crc32c_computed", backend=backend, uri=uri, size=size, crc32c=f"{total:08x}")
    return [f"{t:08x}" for t in totals]
