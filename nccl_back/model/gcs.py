"""The ``gs://`` storage backend: objects read with the real ``google-cloud-storage`` client.

The client honours ``STORAGE_EMULATOR_HOST`` (then anonymous credentials). Every request
has a timeout and is retried with tenacity (exponential backoff with jitter) on 429,
5xx and connection errors; the client's own retries are switched off so ours are the
only ones. Waits between attempts go through :mod:`nccl_back._clock`. One listing gives
every object's size and CRC32C, so a spec downloads no shard byte and sends no
per-object request. The Google client is imported on the first request only: a worker
reading local files never loads it.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from nccl_back.errors import ConfigError, ShardNotFoundError, StorageError
from nccl_back.model.object_store import BufferWriter
from nccl_back.model.storage import (
    Backend,
    Location,
    ObjectInfo,
    register_backend,
    too_large,
    with_retries,
)

T = TypeVar("T")

# GCS bucket names: 3-222 characters of lowercase letters, digits, '-', '_' and '.'.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


def crc32c_from_gcs(b64: str) -> str:
    """GCS metadata reports CRC32C as base64 of 4 big-endian bytes; return 8 hex digits."""
    return base64.b64decode(b64).hex()


def is_transient(e: BaseException) -> bool:
    """Whether a failed request is worth retrying: 429, 5xx, connection errors, timeouts."""
    import requests
    from google.api_core import exceptions as gexc

    if isinstance(e, gexc.GoogleAPICallError):
        code = e.code or 0
        return code == 429 or code >= 500
    return isinstance(e, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError))


@register_backend
class GcsObjects(Backend):
    """Reads ``gs://`` objects; thread-safe.

    ``client`` is a ``google.cloud.storage.Client``, created on first use when None.
    """

    scheme = "gs"
    form = "gs://bucket/prefix"

    @classmethod
    def parse(cls, uri: str, rest: str) -> Location:
        bucket, _, name = rest.partition("/")
        if not _BUCKET_RE.match(bucket):
            raise ConfigError(f"storage URI {uri!r}: bad bucket name {bucket!r}; use gs://bucket/prefix")
        return Location("gs", bucket, name.strip("/"))

    def _make_client(self) -> Any:
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage

        try:
            return storage.Client()
        except DefaultCredentialsError as e:
            raise StorageError(
                f"no Google Cloud credentials for gs:// ({e}); run `gcloud auth "
                "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
            ) from e

    def _describe(self) -> str:
        return f"endpoint {self.client.api_endpoint}, project {self.client.project!r}"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one remote request with retries; map failures to nccl_back errors."""
        from google.api_core import exceptions as gexc

        def known(e: BaseException) -> StorageError | None:
            return ShardNotFoundError(f"{what}: not found") if isinstance(e, gexc.NotFound) else None

        return with_retries(self.settings, what, fn, is_transient, known=known)

    def list_dir(self, loc: Location) -> list[ObjectInfo]:
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

        return self._call(f"listing {loc.uri}", listing)

    def crc32cs(self, infos: Sequence[ObjectInfo], cache_dir: str) -> list[str]:
        # GCS computes every object's CRC32C, composed ones too: the listing has them all.
        missing = [i.uri for i in infos if i.crc32c is None]
        if missing:
            raise StorageError(f"{missing[0]}: the object has no CRC32C in its metadata")
        return [str(i.crc32c) for i in infos]

    def read_bytes(self, loc: Location, *, max_bytes: int) -> bytes:
        what = f"reading {loc.uri}"
        bucket = self.client.bucket(loc.bucket)
        meta = self._call(what, lambda: bucket.get_blob(loc.path, timeout=self.timeout, retry=None))
        if meta is None:
            raise ShardNotFoundError(f"{what}: not found")
        size = int(meta.size or 0)
        if size > max_bytes:
            raise too_large(loc.uri, size, max_bytes)
        if not size:
            return b""  # a range of an empty object is unsatisfiable
        # A fresh Blob (as fetch_into's): the client's endpoint, not the metadata's
        # mediaLink; the generation measured, and no byte past the bound if it is ignored.
        return self._call(what, lambda: bucket.blob(loc.path).download_as_bytes(
            start=0, end=max_bytes, if_generation_match=meta.generation,
            checksum=None, timeout=self.timeout, retry=None))

    def read_range(self, loc: Location, start: int, end: int) -> bytes:
        buf = np.empty(end - start, dtype=np.uint8)
        n = self.fetch_into(loc, buf.data, start)
        return buf[:n].tobytes()

    def fetch_into(self, loc: Location, view: memoryview, start: int) -> int:
        """One ranged GET of ``len(view)`` bytes at ``start`` into ``view``; bytes received."""

        def fetch() -> int:
            # A fresh Blob (no metadata loaded) so the request goes to the client's
            # endpoint, not to a mediaLink that may name another host.
            blob = self.client.bucket(loc.bucket).blob(loc.path)
            writer = BufferWriter(view)
            blob.download_to_file(
                writer, start=start, end=start + len(view) - 1,
                checksum=None, retry=None, timeout=self.timeout,
            )
            return writer.pos

        return self._call(f"downloading {loc.uri} [{start}, {start + len(view)})", fetch)
