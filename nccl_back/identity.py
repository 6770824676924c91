"""Model identity: which checkpoint bytes and config a worker holds.

``ModelSpec.version`` is the MD5 of the canonical JSON of the model config together
with every shard's URI and CRC32C. Hashing the bytes' checksums, not the safetensors
headers, is the point: two checkpoints with identical headers and one differing tensor
must never share a version (vLLM 0.31's header-only key did exactly that).

CRC32C comes for free from object metadata on ``gs://``. For local files it is
computed once, streamed through one reused buffer, and cached on disk keyed by the
file's identity (path, size, mtime, inode, ctime), so a restart reads no shard bytes.
A file modified less than 2 s before it is checksummed is not cached: a same-size
rewrite within the file system's timestamp granularity would keep the same key.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import google_crc32c
import numpy as np

from . import bounded_json
from .config import Settings
from .errors import CheckpointFormatError, ConfigError, ShardNotFoundError, StorageError
from .index import INDEX_NAME, parse_index
from .log import get_logger
from .storage import ObjectInfo, Shard, Storage, parse_uri

__all__ = ["ModelSpec", "Shard", "file_crc32c"]

log = get_logger("nccl_back.identity")

CONFIG_NAME = "config.json"
CACHE_NAME = "crc32c-v1.json"
#: Largest config.json read (real ones are a few KiB; some embed tokenizer tables).
MAX_CONFIG_BYTES = 16 << 20
#: Largest CRC cache or ModelSpec JSON parsed.
_MAX_JSON_BYTES = 256 << 20
# Small enough to stay in CPU cache between the read and the checksum: measured
# 8-14 GB/s with 1 MiB against ~5 GB/s with 16 MiB.
_READ_BUFFER_BYTES = 1 << 20
#: Files modified less than this long before checksumming are not cached (see below).
_RACY_NS = 2_000_000_000

Opener = Callable[[str], IO[bytes]]


def _open_unbuffered(path: str) -> IO[bytes]:
    return open(path, "rb", buffering=0)


def _stream_crc32c(path: str, opener: Opener) -> str:
    buf = np.empty(_READ_BUFFER_BYTES, dtype=np.uint8)
    crc = 0
    with opener(path) as f:
        while n := f.readinto(buf):  # type: ignore[attr-defined]
            # A numpy view, not a memoryview: google_crc32c is several times slower
            # on memoryviews.
            crc = google_crc32c.extend(crc, buf[:n])
    return f"{crc:08x}"


def _file_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


class _CrcCache:
    """CRC32C of local files by absolute path, valid while the file's identity is unchanged."""

    def __init__(self, cache_dir: str) -> None:
        self.path = Path(cache_dir) / CACHE_NAME
        self.dirty = False
        try:
            data = bounded_json.loads(self.path.read_bytes(), max_bytes=_MAX_JSON_BYTES)
            self.entries: dict[str, Any] = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            # A missing or damaged cache only costs a recomputation.
            self.entries = {}

    def get(self, path: str, st: os.stat_result) -> str | None:
        entry = self.entries.get(path)
        if isinstance(entry, dict) and entry.get("key") == _file_key(st):
            crc = entry.get("crc32c")
            return crc if isinstance(crc, str) else None
        return None

    def put(self, path: str, st: os.stat_result, crc: str) -> None:
        self.entries[path] = {"key": _file_key(st), "crc32c": crc}
        self.dirty = True

    def save(self) -> None:
        """Write atomically (tmp + rename): a concurrent reader sees the old or new file."""
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".crc32c-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f, sort_keys=True)
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as e:
            # The cache is an optimisation: failing to write it must not fail the load.
            log.warning("crc_cache_write_failed", path=str(self.path), error=str(e))


def file_crc32c(
    path: str, *, cache_dir: str | None = None, opener: Opener = _open_unbuffered
) -> str:
    """CRC32C (8 hex digits) of a local file, from the cache in ``cache_dir`` when valid."""
    cache = _CrcCache(cache_dir or Settings().cache_dir)
    crc = _cached_crc32c(os.path.abspath(path), cache, opener)
    cache.save()
    return crc


def _cached_crc32c(path: str, cache: _CrcCache, opener: Opener) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"shard {path!r} does not exist") from e
    crc = cache.get(path, st)
    if crc is None:
        started = time.time_ns()
        crc = _stream_crc32c(path, opener)
        # Cache only a file that was not rewritten while we read it, and whose mtime is
        # older than the file system's timestamp granularity ("racy git"): a same-size
        # rewrite within that window would keep the same key and reuse a stale CRC.
        if _file_key(os.stat(path)) == _file_key(st) and st.st_mtime_ns < started - _RACY_NS:
            cache.put(path, st, crc)
        log.debug("crc32c_computed", path=path, size=st.st_size, crc32c=crc)
    return crc


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint's identity: its config and its shards (kept sorted by URI)."""

    config: Mapping[str, Any]
    shards: tuple[Shard, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.config, Mapping):
            raise ConfigError(f"ModelSpec config must be a mapping, got {type(self.config).__name__}")
        try:
            json.dumps(self.config, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"ModelSpec config is not JSON-serialisable: {e}") from e
        shards = tuple(sorted(self.shards, key=lambda s: s.uri))
        uris = [s.uri for s in shards]
        if len(set(uris)) != len(uris):
            raise ConfigError(f"ModelSpec lists a shard twice: {uris}")
        object.__setattr__(self, "shards", shards)

    @property
    def version(self) -> str:
        """MD5 hex of the canonical JSON of the config and every shard's URI and CRC32C."""
        payload = json.dumps(
            {"config": self.config, "shards": [[s.uri, s.crc32c] for s in self.shards]},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.md5(payload.encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        """Total size of the shards in bytes."""
        return sum(s.size for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": dict(self.config),
            "shards": [[s.uri, s.crc32c, s.size] for s in self.shards],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> ModelSpec:
        """Inverse of :meth:`to_json` (also accepts the JSON text)."""
        try:
            raw = (
                bounded_json.loads(data, max_bytes=_MAX_JSON_BYTES, allow_constants=True)
                if isinstance(data, (str, bytes))
                else data
            )
            shards = tuple(Shard(str(u), str(c), int(n)) for u, c, n in raw["shards"])
            return cls(dict(raw["config"]), shards)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed ModelSpec JSON: {e!r}") from e

    @classmethod
    def from_dir(
        cls,
        path_or_uri: str,
        *,
        cache_dir: str | None = None,
        client: Any = None,
        storage: Storage | None = None,
        opener: Opener = _open_unbuffered,
    ) -> ModelSpec:
        """The spec of the checkpoint in a local directory or ``gs://`` prefix.

        Reads ``config.json`` and the ``*.safetensors`` shards; when
        ``model.safetensors.index.json`` is present only the shards it lists count (a
        consolidated copy next to them is ignored). ``opener`` opens local shards for
        checksumming (tests inject one to count reads).
        """
        storage = storage or Storage(client=client)
        root = parse_uri(path_or_uri)
        try:
            files = {i.name: i for i in storage.list_dir(root.uri)}
        except ShardNotFoundError as e:
            raise ShardNotFoundError(
                f"checkpoint {root.uri!r} not found; give the directory (or gs:// prefix) "
                "holding config.json and the *.safetensors shards"
            ) from e
        if CONFIG_NAME not in files:
            raise ShardNotFoundError(f"{root.join(CONFIG_NAME).uri!r} does not exist")
        config_uri = files[CONFIG_NAME].uri
        if files[CONFIG_NAME].size > MAX_CONFIG_BYTES:
            raise CheckpointFormatError(
                f"{config_uri}: {files[CONFIG_NAME].size} bytes, over the {MAX_CONFIG_BYTES}-byte limit"
            )
        try:
            config = bounded_json.loads(
                storage.read_bytes(config_uri), max_bytes=MAX_CONFIG_BYTES, allow_constants=True
            )
        except ValueError as e:
            raise CheckpointFormatError(f"{config_uri}: malformed JSON: {e}") from e
        if not isinstance(config, dict):
            raise CheckpointFormatError(f"{config_uri}: expected a JSON object")
        if INDEX_NAME in files:
            index_uri = files[INDEX_NAME].uri
            names = sorted(set(parse_index(storage.read_bytes(index_uri), index_uri).values()))
            missing = [n for n in names if n not in files]
            if missing:
                raise ShardNotFoundError(
                    f"{index_uri} lists shards that do not exist: {[root.join(n).uri for n in missing]}"
                )
        else:
            names = [n for n in files if n.endswith(".safetensors")]
        if not names:
            raise ShardNotFoundError(f"no *.safetensors shards in {root.uri!r}")
        infos = [files[n] for n in names]
        if root.is_local:
            crcs = _local_crc32cs([i.uri for i in infos], cache_dir, opener)
        else:
            crcs = [_remote_crc32c(i) for i in infos]
        return cls(config, tuple(Shard(i.uri, c, i.size) for i, c in zip(infos, crcs, strict=True)))


def _local_crc32cs(paths: list[str], cache_dir: str | None, opener: Opener) -> list[str]:
    cache = _CrcCache(cache_dir or Settings().cache_dir)
    # Threads overlap one file's read (GIL released) with another's checksum.
    workers = max(1, min(4, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-crc") as pool:
        crcs = list(pool.map(lambda p: _cached_crc32c(p, cache, opener), paths))
    cache.save()
    return crcs


def _remote_crc32c(info: ObjectInfo) -> str:
    if info.crc32c is None:
        raise StorageError(f"{info.uri}: the object has no CRC32C in its metadata")
    return info.crc32c
