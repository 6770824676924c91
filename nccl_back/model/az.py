"""The ``az://container/prefix`` storage backend: Azure Blob Storage through the official
``azure-storage-blob`` client (``azure-identity`` for the credential chain), configured
as the Azure SDK and CLI are, with the variable names adlfs and Run:ai's streamer use as
aliases (:meth:`AzureBlobs._make_client`; docs/getting-started.md).

Requests: connect and read timeouts, the SDK's own retries off, ours
(:func:`~nccl_back.model.storage.with_retries`) on 429, 5xx, ``ServerBusy`` and
connection errors. Ranged reads are one GET each, streamed into the destination: the
SDK's ``download_blob`` reads each response whole into memory and retries body reads
itself with real sleeps, so reads go through the generated ``Get Blob`` operation it
wraps.

CRC32C: Azure stores a Content-MD5 at most and no CRC32C, so each blob's is computed
and cached as :mod:`~nccl_back.model.object_store` says (the endpoint names the account).

The Azure libraries are imported on the first request only.
"""

from __future__ import annotations

import math
import os
import re
import ssl
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import parse_qs

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.errors import ConfigError, ShardNotFoundError, StorageError
from nccl_back.model.object_store import Body, BufferWriter, ObjectStore
from nccl_back.model.storage import DEFAULT_TIMEOUT, Location, ObjectInfo, register_backend

T = TypeVar("T")

# Container names: 3-63 lowercase letters, digits and single hyphens, starting and
# ending with a letter or digit.
_CONTAINER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9]|-(?!-)){1,61}[a-z0-9]$")
_CONTAINER_RULES = "3-63 lowercase letters, digits and single '-'"
_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_ENDPOINT_RE = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
_PAGE = 5000
#: Bytes the transport reads from a response at a time.
_READ_BYTES = 1 << 20

_TRANSIENT_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})
_DENIED_CODES = frozenset({
    "AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
    "AuthorizationResourceTypeMismatch", "InsufficientAccountPermissions",
    "AuthorizationSourceIPMismatch", "AuthorizationProtocolMismatch",
})
_CREDENTIALS_FIX = (
    "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY,"
    " AZURE_STORAGE_SAS_TOKEN or an Azure identity (workload or managed identity,"
    " AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, `az login`)"
)
_ENDPOINT_FIX = ("set AZURE_STORAGE_SERVICE_ENDPOINT (or BlobEndpoint= in the connection"
                 " string) for an emulator or a sovereign cloud")


def _error_code(e: Any) -> tuple[str, int]:
    """An HTTP error's ``x-ms-error-code`` and status (``("", 0)`` when there is none)."""
    response = getattr(e, "response", None)
    code = getattr(e, "error_code", None) or (
        response.headers.get("x-ms-error-code") if response is not None else None)
    status = getattr(e, "status_code", None) or 0
    return str(getattr(code, "value", code) or ""), int(status) if isinstance(status, int) else 0


def _tls(e: BaseException) -> bool:
    import requests

    inner = getattr(e, "inner_exception", None) or e.__cause__
    return isinstance(inner, (ssl.SSLError, requests.exceptions.SSLError))


def is_transient(e: BaseException) -> bool:
    """Whether a failed request is worth retrying: 429, 5xx, throttling, connection errors."""
    from azure.core import exceptions as aexc

    if isinstance(e, aexc.ClientAuthenticationError):
        return False  # a credential refused, or none found: asking again changes nothing
    if isinstance(e, aexc.DecodeError):
        return True  # a body cut short (IncompleteReadError)
    if isinstance(e, aexc.HttpResponseError) and getattr(e, "response", None) is not None:
        code, status = _error_code(e)
        return status == 429 or status >= 500 or code in _TRANSIENT_CODES
    if isinstance(e, (aexc.ServiceRequestError, aexc.ServiceResponseError)):
        return not _tls(e)  # a certificate that failed will fail again
    return isinstance(e, (ConnectionError, TimeoutError))


def quoted(etag: str) -> str:
    """An ETag as HTTP headers carry it (listings give it without the quotes)."""
    return f'"{etag.strip(chr(34))}"'


def sas_expiry(token: str) -> datetime | None:
    """When a SAS token's ``se=`` says it expires; None if it says nothing parseable."""
    try:
        se = parse_qs(token.lstrip("?")).get("se", [""])[0]
        return datetime.fromisoformat(se.replace("Z", "+00:00")) if se else None
    except ValueError:
        return None


@register_backend
class AzureBlobs(ObjectStore):
    """Reads ``az://`` blobs; thread-safe (one ``BlobServiceClient``, made on first use).

    ``env`` is where the account and credentials are read (``os.environ`` when None).
    """

    scheme = "az"
    form = "az://container/prefix"
    transient = staticmethod(is_transient)
    endpoint_fix = _ENDPOINT_FIX

    def __init__(self, settings: Settings, *, client: Any = None, timeout: float = DEFAULT_TIMEOUT,
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__(settings, timeout=timeout, client=client)
        self.env = os.environ if env is None else env
        self.how = "the client given" if client is not None else ""
        self._credential: Any = None
        self._sas = ""

    @classmethod
    def parse(cls, uri: str, rest: str) -> Location:
        container, _, name = rest.partition("/")
        if not _CONTAINER_RE.match(container):
            raise ConfigError(f"storage URI {uri!r}: bad container name {container!r}"
                              f" ({_CONTAINER_RULES}); use az://container/prefix")
        return Location("az", container, name.strip("/"))

    def _make_client(self) -> Any:
        import requests
        from azure.core.pipeline.transport import RequestsTransport
        from azure.storage.blob import BlobServiceClient

        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(
            pool_maxsize=max(10, 2 * self.settings.storage_workers))
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        options: dict[str, Any] = {
            "retry_total": 0,  # ours are the only retries
            "transport": RequestsTransport(
                session=session, session_owner=True, connection_timeout=self.timeout,
                read_timeout=self.timeout, connection_data_block_size=_READ_BYTES),
        }
        env = self.env
        conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "")
        if conn:
            try:
                client = BlobServiceClient.from_connection_string(conn, **options)
            except ValueError as e:  # the string holds a key: never echo it
                raise StorageError(f"AZURE_STORAGE_CONNECTION_STRING is malformed ({e});"
                                   " give DefaultEndpointsProtocol=...;AccountName=...;"
                                   "AccountKey=... (or SharedAccessSignature=...)") from e
            fields = dict(p.partition("=")[::2] for p in conn.split(";") if "=" in p)
            self._sas = fields.get("SharedAccessSignature", "")
            kind = "SAS" if self._sas else "account key" if "AccountKey" in fields else "anonymous"
            self.how = f"AZURE_STORAGE_CONNECTION_STRING ({kind})"
            return client
        account = env.get("AZURE_STORAGE_ACCOUNT") or env.get("AZURE_STORAGE_ACCOUNT_NAME", "")
        if not account:
            raise StorageError(f"no Azure storage account: {_CREDENTIALS_FIX}")
        if not _ACCOUNT_RE.match(account):
            raise ConfigError(f"AZURE_STORAGE_ACCOUNT={account!r}: give 3-24 lowercase letters"
                              " and digits")
        endpoint = env.get("AZURE_STORAGE_SERVICE_ENDPOINT") or f"https://{account}.blob.core.windows.net"
        if not _ENDPOINT_RE.match(endpoint):
            raise ConfigError(f"AZURE_STORAGE_SERVICE_ENDPOINT={endpoint!r}: give"
                              " http(s)://host[:port][/path]")
        key = env.get("AZURE_STORAGE_KEY") or env.get("AZURE_STORAGE_ACCOUNT_KEY", "")
        # The SAS only where it is the credential used (its expiry explains a refusal).
        self._sas = "" if key else env.get("AZURE_STORAGE_SAS_TOKEN", "").lstrip("?")
        credential: Any
        if key:
            credential, self.how = {"account_name": account, "account_key": key}, "account key"
        elif self._sas:
            from azure.core.credentials import AzureSasCredential

            credential, self.how = AzureSasCredential(self._sas), "SAS token"
        else:
            from azure.identity import DefaultAzureCredential

            credential = self._credential = DefaultAzureCredential()
            self.how = "DefaultAzureCredential"
        return BlobServiceClient(endpoint, credential=credential, **options)

    @property
    def _server_timeout(self) -> int:
        """The seconds the service may spend on one operation (whole seconds, at least 1)."""
        return max(1, math.ceil(self.timeout))

    @property
    def endpoint(self) -> str:
        """The account's blob endpoint (its URL names the account)."""
        return str(self.client.url)

    def _describe(self) -> str:
        account, endpoint, how = self.client.account_name, self.endpoint, self.how
        won = getattr(self._credential, "_successful_credential", None)
        if won is not None:  # the credential of the chain that gave the token
            how = f"{how}: {type(won).__name__}"
        return f"account {account}, endpoint {endpoint}, credentials from {how}"

    def _call(self, what: str, loc: Location, fn: Callable[[], T]) -> T:
        try:
            self.client  # noqa: B018  (made here, so a missing account names the URI)
        except StorageError as e:
            raise type(e)(f"{what}: {e}") from e
        return super()._call(what, loc, fn)

    def _known(self, what: str, loc: Location, e: BaseException) -> StorageError | None:
        from azure.core import exceptions as aexc

        if isinstance(e, aexc.ClientAuthenticationError) and getattr(e, "response", None) is None:
            return StorageError(f"{what}: no usable Azure credential"
                                f" ({str(e).splitlines()[0][:300]}); {_CREDENTIALS_FIX}")
        if isinstance(e, aexc.ServiceRequestError) and _tls(e):
            return StorageError(f"{what}: TLS failed ({e}); set REQUESTS_CA_BUNDLE to the CA"
                                " bundle that signed the endpoint's certificate")
        if not isinstance(e, aexc.HttpResponseError) or getattr(e, "response", None) is None:
            return None
        code, status = _error_code(e)
        if code == "ContainerNotFound":
            return ShardNotFoundError(
                f"{what}: container {loc.bucket!r} does not exist in account"
                f" {self.client.account_name} ({self.endpoint}); check the name, or the account"
                " (AZURE_STORAGE_ACCOUNT, the connection string)")
        if status == 404:
            return ShardNotFoundError(f"{what}: not found")
        if status in (401, 403) or code in _DENIED_CODES:
            expiry = sas_expiry(self._sas) if self._sas else None
            if expiry is not None and expiry.timestamp() <= _clock.wall():
                return StorageError(
                    f"{what}: access denied ({code or status}): the SAS token expired at"
                    f" {expiry.isoformat()}; give a fresh one (AZURE_STORAGE_SAS_TOKEN, or"
                    " SharedAccessSignature= in AZURE_STORAGE_CONNECTION_STRING)")
            return StorageError(
                f"{what}: access denied ({code or status}); give these credentials read access to"
                f" container {loc.bucket!r} (the role Storage Blob Data Reader, or a SAS with"
                " read and list permissions)")
        if status == 412 or code == "ConditionNotMet":
            return StorageError(f"{what}: the blob was replaced while it was read; run again")
        if status == 416 or code == "InvalidRange":
            return StorageError(f"{what}: the blob is shorter than that (InvalidRange); it changed"
                                " after it was listed: run again")
        if is_transient(e):
            return StorageError(f"{what}: failed after {self.settings.storage_attempts} attempts:"
                                f" {code or status}")
        return StorageError(f"{what}: {code or status}: {str(e).splitlines()[0][:300]}")

    # -- listing and checksums ---------------------------------------------------------

    def _pages(self, loc: Location, prefix: str) -> Iterator[Any]:
        container = self.client.get_container_client(loc.bucket)
        return container.walk_blobs(name_starts_with=prefix or None, delimiter="/",
                                    results_per_page=_PAGE, timeout=self._server_timeout).by_page()

    def _object_info(self, loc: Location, prefix: str, item: Any) -> ObjectInfo | None:
        """A listed blob, or None for an entry that is not one directly inside (a
        sub-prefix; anything malformed is logged)."""
        from azure.storage.blob import BlobPrefix

        if isinstance(item, BlobPrefix):
            return None
        etag = getattr(item, "etag", None)
        return self._listed(loc, prefix, getattr(item, "name", None), getattr(item, "size", None),
                            quoted(etag) if isinstance(etag, str) and etag.strip('"') else None)

    # -- reads -------------------------------------------------------------------------

    def _past_end(self, e: BaseException | None) -> bool:
        return _error_code(e)[0] == "InvalidRange"

    def _open(self, loc: Location, start: int, n: int, etag: str) -> Body:
        blob = self.client.get_blob_client(loc.bucket, loc.path)
        # The generated Get Blob under download_blob: the response streamed, not held whole.
        response, stream = blob._client.blob.download(
            range=f"bytes={start}-{start + n - 1}", timeout=self._server_timeout, decompress=False,
            headers={"If-Match": etag} if etag else {},
            cls=lambda pipeline, body, headers: (pipeline.http_response, body),
        )
        length = response.headers.get("Content-Length", "")
        whole = int(length) if response.status_code == 200 and length.isdigit() else None
        return Body(response.headers.get("Content-Range"), whole, iter(stream), response.close)

    def fetch_into(self, loc: Location, view: memoryview, start: int) -> int:
        """One ranged GET of ``len(view)`` bytes at ``start`` into ``view``; a blob that
        ends before them is an error naming its size."""
        what = f"downloading {loc.uri} [{start}, {start + len(view)})"

        def fetch() -> int:
            got, total = self._get(loc, start, len(view), what, BufferWriter(view).write)
            if got != len(view):
                raise StorageError(f"{what}: the blob is {total} bytes, not the"
                                   f" {start + len(view)} or more listed; it changed after it"
                                   " was listed: run again")
            return got

        return self._call(what, loc, fetch)
