"""The ``s3://bucket/prefix`` storage backend, through ``boto3``: AWS S3 or any
S3-compatible store (MinIO, Cloudflare R2, Ceph), configured as boto3 always is, plus
``Settings.s3_endpoint_url`` (endpoint, credentials, region: docs/getting-started.md).

Requests: connect and read timeouts, botocore's own retries off, ours
(:func:`~nccl_back.model.storage.with_retries`) on 429, 5xx, ``SlowDown`` and
connection errors. CRC32C: a listing gives no checksum values, so each object is asked
once (HeadObject, ``ChecksumMode=ENABLED``). A composite ``ChecksumCRC32C`` (a
multipart upload's, ``...-N``) is no CRC32C of the object and counts as absent: then
it is computed and cached as :mod:`~nccl_back.model.object_store` says.

boto3 is imported on the first request only.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nccl_back.errors import ConfigError, ShardNotFoundError, StorageError
from nccl_back.log import get_logger
from nccl_back.model.object_store import Body, ObjectStore
from nccl_back.model.storage import Location, ObjectInfo, register_backend

log = get_logger("nccl_back.model.storage")

# S3 bucket names: 3-63 lowercase letters, digits, '.' and '-', starting and ending
# with a letter or digit, no '..', not an IPv4 address.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
_BUCKET_RULES = "3-63 lowercase letters, digits, '.' and '-'"
#: Bytes read from a response body at a time (a CRC pass keeps no more per worker).
_READ_BYTES = 1 << 20

_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
    "ServiceUnavailable", "RequestLimitExceeded",
})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_DENIED_CODES = frozenset({
    "AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "AllAccessDisabled",
})
_CREDENTIALS_FIX = (
    "give this worker AWS credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
    " AWS_PROFILE, or a pod or instance role"
)
_ENDPOINT_FIX = "set AWS_ENDPOINT_URL_S3 (or NCCL_BACK_S3_ENDPOINT_URL) for a store other than AWS"


def whole_object_crc32c(value: Any, checksum_type: Any, etag: Any) -> str | None:
    """The object's CRC32C as 8 hex digits from HeadObject's ``ChecksumCRC32C``, or None
    when there is none or it is composite (a multipart upload's CRC of its parts' CRCs:
    ``...-N``, ``ChecksumType`` ``COMPOSITE``, or no type on a multipart ETag)."""
    if not isinstance(value, str) or "-" in value or checksum_type == "COMPOSITE":
        return None
    multipart = isinstance(etag, str) and re.search(r"-\d+\"?$", etag) is not None
    if multipart and checksum_type != "FULL_OBJECT":
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 4 else None


def _error_code(e: Any) -> tuple[str, int]:
    response = getattr(e, "response", None) or {}
    code = str((response.get("Error") or {}).get("Code", ""))
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
    return code, int(status) if isinstance(status, int) else 0


def is_transient(e: BaseException) -> bool:
    """Whether a failed request is worth retrying: 429, 5xx, throttling, connection errors."""
    from botocore import exceptions as bexc

    if isinstance(e, bexc.ClientError):
        code, status = _error_code(e)
        return status == 429 or status >= 500 or code in _TRANSIENT_CODES
    if isinstance(e, bexc.SSLError):
        return False  # a certificate that failed will fail again
    return isinstance(e, (bexc.HTTPClientError, bexc.ConnectionError, ConnectionError, TimeoutError))


@register_backend
class S3Objects(ObjectStore):
    """Reads ``s3://`` objects; thread-safe (one boto3 client, made on first use)."""

    scheme = "s3"
    form = "s3://bucket/prefix"
    transient = staticmethod(is_transient)
    endpoint_fix = _ENDPOINT_FIX
    _session: Any = None
    """The boto3 session :meth:`_make_client` made (None with a client given)."""

    @classmethod
    def parse(cls, uri: str, rest: str) -> Location:
        bucket, _, key = rest.partition("/")
        if not _BUCKET_RE.match(bucket) or ".." in bucket or _IPV4_RE.match(bucket):
            raise ConfigError(f"storage URI {uri!r}: bad bucket name {bucket!r} ({_BUCKET_RULES});"
                              " use s3://bucket/prefix")
        return Location("s3", bucket, key.strip("/"))

    def _make_client(self) -> Any:
        import boto3
        from botocore import exceptions as bexc
        from botocore.config import Config

        config = Config(
            connect_timeout=self.timeout, read_timeout=self.timeout,
            retries={"total_max_attempts": 1},  # ours are the only retries
            max_pool_connections=max(10, 2 * self.settings.storage_workers),
            # We check CRC32C over the bytes copied; botocore's own (CRC32 on
            # uploads, whole-object checks) would only add work.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            self._session = boto3.session.Session()
            return self._session.client(
                "s3", endpoint_url=self.settings.s3_endpoint_url or None, config=config
            )
        except (bexc.BotoCoreError, ValueError) as e:
            raise StorageError(f"s3://: cannot make a client ({e}); check AWS_PROFILE,"
                               f" the AWS config file and the endpoint") from e

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def _describe(self) -> str:
        creds = self._session.get_credentials() if self._session is not None else None
        who = f"credentials from {creds.method}" if creds is not None else "no credentials"
        return f"endpoint {self.endpoint}, region {self.client.meta.region_name}, {who}"

    def _known(self, what: str, loc: Location, e: BaseException) -> StorageError | None:
        from botocore import exceptions as bexc

        if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError,
                          bexc.CredentialRetrievalError)):
            return StorageError(f"{what}: no usable AWS credentials ({e}); {_CREDENTIALS_FIX}")
        if isinstance(e, bexc.SSLError):
            return StorageError(f"{what}: TLS failed ({e}); set AWS_CA_BUNDLE to the CA"
                                " bundle that signed the endpoint's certificate")
        if not isinstance(e, bexc.ClientError):
            return None
        code, status = _error_code(e)
        if code == "NoSuchBucket":
            return ShardNotFoundError(f"{what}: bucket {loc.bucket!r} does not exist at"
                                      f" {self.endpoint}; check the name, or {_ENDPOINT_FIX}")
        if code in _NOT_FOUND_CODES or status == 404:
            return ShardNotFoundError(f"{what}: not found")
        if code in _DENIED_CODES or status == 403:
            return StorageError(f"{what}: access denied ({code}); give these credentials"
                                f" s3:ListBucket and s3:GetObject on bucket {loc.bucket!r}")
        if code == "PreconditionFailed" or status == 412:
            return StorageError(f"{what}: the object was rewritten while it was read; retry")
        if status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            return StorageError(f"{what}: bucket {loc.bucket!r} is in another region ({code});"
                                " set AWS_REGION to the bucket's region")
        if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
            return StorageError(f"{what}: failed after {self.settings.storage_attempts} attempts:"
                                f" {code or status}")
        return StorageError(f"{what}: {code or status}: {e}")

    # -- listing and checksums ---------------------------------------------------------

    def _pages(self, loc: Location, prefix: str) -> Iterator[list[Any]]:
        args: dict[str, Any] = {"Bucket": loc.bucket, "Prefix": prefix, "Delimiter": "/"}
        while True:
            page = self.client.list_objects_v2(**args)
            yield page.get("Contents") or []
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not isinstance(token, str) or not token:
                return
            args["ContinuationToken"] = token

    def _object_info(self, loc: Location, prefix: str, item: Any) -> ObjectInfo | None:
        return self._listed(loc, prefix, item.get("Key"), item.get("Size"), item.get("ETag"))

    def _metadata_crc32cs(self, infos: Sequence[ObjectInfo]) -> list[str | None]:
        workers = max(1, min(self.settings.storage_workers, len(infos)))
        with ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-s3-head") as pool:
            return list(pool.map(self._head_crc32c, infos))

    def _head_crc32c(self, info: ObjectInfo) -> str | None:
        """The whole-object CRC32C in ``info``'s metadata; None if it has none."""
        loc = self._loc(info)
        head = self._call(
            f"reading the metadata of {info.uri}", loc,
            lambda: self.client.head_object(Bucket=loc.bucket, Key=loc.path, ChecksumMode="ENABLED"),
        )
        etag, size = head.get("ETag"), head.get("ContentLength")
        if (info.tag and etag != info.tag) or size != info.size:
            raise StorageError(f"{info.uri} changed after it was listed (ETag {info.tag} size"
                               f" {info.size}, now {etag} size {size}); run again")
        crc = whole_object_crc32c(head.get("ChecksumCRC32C"), head.get("ChecksumType"), etag)
        if crc is None:
            log.info("s3_no_whole_object_crc32c", uri=info.uri, size=info.size,
                     checksum=str(head.get("ChecksumCRC32C"))[:40])
        return crc

    # -- reads -------------------------------------------------------------------------

    def _open(self, loc: Location, start: int, n: int, etag: str) -> Body:
        resp = self.client.get_object(
            Bucket=loc.bucket, Key=loc.path, Range=f"bytes={start}-{start + n - 1}",
            **({"IfMatch": etag} if etag else {}))
        body, ranged, length = resp["Body"], resp.get("ContentRange"), resp.get("ContentLength")

        def chunks() -> Iterator[bytes]:
            got = 0
            while chunk := body.read(min(_READ_BYTES, n - got + 1)):
                got += len(chunk)
                yield chunk

        return Body(ranged if isinstance(ranged, str) else None,
                    length if isinstance(length, int) else None, chunks(), body.close)

    def _past_end(self, e: BaseException | None) -> bool:
        from botocore import exceptions as bexc

        return isinstance(e, bexc.ClientError) and _error_code(e)[0] == "InvalidRange"
