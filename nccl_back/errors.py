"""The one error hierarchy of nccl_back.

Every error the library raises on purpose derives from :class:`NcclBackError`, so a
caller can catch one class. Each subclass's docstring says when it is raised. Errors
that wrap a lower-level failure chain it (``raise ... from e``).
"""

from __future__ import annotations

import enum


class NcclBackError(Exception):
    """Root of every error nccl_back raises on purpose."""


class ConfigError(NcclBackError, ValueError):
    """A setting, flag, URL or environment variable has a bad value.

    The message names the bad value and how to fix it.
    """


class StorageError(NcclBackError):
    """Reading a checkpoint from storage failed (missing object, I/O error, retries spent)."""


class ShardNotFoundError(StorageError, FileNotFoundError):
    """A checkpoint directory, shard or object named by the spec does not exist."""


class ChecksumMismatchError(StorageError):
    """A downloaded shard's CRC32C differs from the checksum in its metadata, after retries."""


class CheckpointFormatError(StorageError):
    """A safetensors file (or its index) is truncated or malformed; the message names the file."""


class SkeletonError(NcclBackError):
    """A skeleton model could not be built or does not fit what must be loaded into it."""


class WeightLoadError(NcclBackError):
    """After a load, tensors were missing, unexpected or filled twice (load tracking).

    Also raised when a checkpoint tensor does not fit its skeleton container (dtype or
    shape mismatch): nccl_back never casts silently.
    """


class WeightVerificationError(NcclBackError):
    """Integrity hashes computed after a load differ from the ground truth; names the
    layers (or the checkpoint tensors, for checks in checkpoint coordinates) that differ,
    also as ``bad``."""

    def __init__(self, message: str, bad: set[str] | frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.bad = frozenset(bad)


class RegistryError(NcclBackError):
    """Redis, the coordination store, is unreachable or answered with something unexpected."""


class UntrustedRecordError(RegistryError):
    """A value read from Redis is not to be acted on: unsigned or badly signed while a
    secret is set, expired, malformed or out of bounds, or kept without a TTL.

    The record is skipped (logged and counted); other records are still used.
    """


class PeerError(NcclBackError):
    """A peer load could not be carried out; the subclasses say why. Triggers fallback."""


class NoPeerError(PeerError):
    """No live peer holds this version (for this rank), or every candidate was claimed."""


class BudgetSpentError(NoPeerError):
    """A phase of one load used up its time bound (:mod:`nccl_back.budget`) before a
    peer served it: the load goes on to the next source or to storage."""


class HandshakeTimeoutError(PeerError, TimeoutError):
    """The liveness handshake did not complete within its timeout; no communicator was made."""


class ManifestMismatchError(PeerError):
    """Sender and receiver disagree on the tensors to transfer (names, shapes or dtypes)."""


class TransferError(PeerError):
    """The transport failed while creating the communicator or moving data (peer crashed)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """The watchdog deadline passed during communicator creation or the broadcast loop.

    The communicator was aborted before this was raised.
    """


class TransferStalledError(TransferTimeoutError):
    """No step of a transfer completed within its stall bound (a silent peer: stopped,
    partitioned, its link down without a reset), long before the deadline. The
    communicator was aborted before this was raised."""


class TransferAbandonedError(TransferError):
    """The sender gave the transfer up after the handshake (it closed, past its drain's
    bound) and left a notice saying so; the communicator was aborted before this was
    raised, long before the stall bound."""


class IncompatiblePeerError(PeerError):
    """The peers holding this version cannot serve this receiver: they speak another
    transport or hold their weights on another device kind. Raised at discovery (before
    any claim) or when a sender refuses the request before creating anything."""


class LayoutMismatchError(IncompatiblePeerError):
    """This worker cannot reshard: an engine adapter could not describe its layout as
    pieces of the checkpoint (a quantized or unknown layer, pipeline parallelism...),
    so it loads only from peers of exactly its layout, or from storage."""


class ConsensusError(PeerError):
    """The worker's ranks could not agree: a collective over the worker's group failed, or
    another rank failed (the message names it) and this rank follows it.

    ``failed_rank`` is the rank whose failure this one follows (None: the group itself failed).
    """

    def __init__(self, message: str, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class ArtifactError(NcclBackError):
    """An artifact set (compile caches) is refused: a malformed or oversized manifest, a
    path that would leave the cache directory, bytes whose keyed digest differs, no
    fleet secret; or it could not be collected or installed. Nothing of a refused set
    is written to the cache directory."""


class UntrustedPathError(ArtifactError):
    """A compile-cache directory or file another local user could have written (owned by
    another uid, writable by group or others, a symlink, a hard link, changed while it
    was read; :mod:`nccl_back.model.trusted_tree`): nothing under it is published, and
    nothing is installed into it."""


class AttachError(NcclBackError):
    """A local hand-off from a sidecar was refused or failed (version/manifest mismatch, I/O)."""


# -- fallback codes ---------------------------------------------------------------------

FALLBACK_REASONS = (
    "no_peer",
    "incompatible_peer",
    "layout_mismatch",
    "handshake_timeout",
    "transfer_timeout",
    "transfer_error",
    "manifest_mismatch",
    "verification_failed",
    "registry_error",
    "consensus",
    "untrusted_record",
    "other",
)
"""Stable codes for why a worker loaded from storage instead of a peer (metric labels,
the prefix of ``LoadResult.fallback_reason``)."""

class StrEnum(str, enum.Enum):
    """An enumeration whose members are their string values (``str(m) == m.value``), so a
    member is its own metric label or table cell (``enum.StrEnum`` from Python 3.11)."""

    def __str__(self) -> str:
        return self.value


class RecordKind(StrEnum):
    """Every kind of value nccl_back reads from Redis and may reject: the one list that
    records, the registry (:meth:`Registry.reject`), the metrics (a label of
    ``records_rejected``) and error messages share. A ``str``, so it is its own label."""

    PEER = "peer"
    """A peer entry (``ns:peer:...``)."""
    INDEX = "index"
    """The set of peer ids of one version and rank (``ns:peers:...``)."""
    GROUND_TRUTH = "ground_truth"
    """Integrity hashes of a storage load (``ns:gt:...``)."""
    REQUEST = "request"
    """A transfer request queued for a sender (``ns:req:...``)."""
    HANDSHAKE = "handshake"
    """A liveness-handshake value or refusal (``ns:hs:...``)."""
    CLAIM = "claim"
    """A receiver's send slot on a peer (``ns:claim:...``)."""
    LEASE = "lease"
    """The single-flight download lease (``ns:dl:...``)."""
    DOWNLOAD_GROUP = "download_group"
    """A worker waiting with others for a version nobody holds (``ns:dlg:...``)."""
    DOWNLOAD_ROSTER = "download_roster"
    """The members of a cooperative download, named by the worker elected (``ns:dlr:...``)."""
    DOWNLOAD_MEMBER = "download_member"
    """Where a cooperative download's member serves its part (``ns:dlm:...``)."""
    DOWNLOAD_RESCUE = "download_rescue"
    """Failed members' parts of a cooperative download, spread over the others (``ns:dlx:...``)."""
    COHORT_MEMBER = "cohort_member"
    """One member's relay endpoint in a cohort chain (``ns:cohort:...:{e}:{c}``)."""
    DOWNLOAD_STREAM = "download_stream"
    """The relay endpoint a download is streamed from (``ns:stream:...``)."""
    LAYOUT = "layout"
    """A layout description (``ns:layout:...``, resharding)."""
    POSITION_TRUTH = "position_truth"
    """Truth in checkpoint coordinates (``ns:ct:...``, resharding)."""
    GROUP = "group"
    """The holder layouts a reshard plan is computed over (``ns:group:...``)."""
    GONE = "gone"
    """A relay endpoint's tombstone (``ns:gone:...``)."""
    ALIVE = "alive"
    """A relay endpoint's liveness mark, renewed while it serves (``ns:alive:...``)."""
    VERDICT = "verdict"
    """A relay member's own check of what it received, passed or failed (``ns:verdict:...``)."""
    RENDEZVOUS = "rendezvous"
    """A process group's bootstrap value (``ns:rdv:...``)."""
    ARTIFACT_SET = "artifact_set"
    """An artifact set's manifest (``ns:art:...``, compile caches)."""
    ARTIFACT_INDEX = "artifact_index"
    """A model's newest artifact set and its factors (``ns:artidx:...``)."""


RECORD_KINDS = tuple(k.value for k in RecordKind)
"""The :class:`RecordKind` values (metric labels of rejected records)."""

# Most specific class first: TransferTimeoutError is also a TransferError.
_REASON_BY_ERROR: tuple[tuple[type[BaseException], str], ...] = (
    # First: a peer list of only rejected records is also a NoPeerError.
    (UntrustedRecordError, "untrusted_record"),
    (NoPeerError, "no_peer"),
    (LayoutMismatchError, "layout_mismatch"),
    (IncompatiblePeerError, "incompatible_peer"),
    (HandshakeTimeoutError, "handshake_timeout"),
    (TransferTimeoutError, "transfer_timeout"),
    (TransferError, "transfer_error"),
    (ManifestMismatchError, "manifest_mismatch"),
    (WeightVerificationError, "verification_failed"),
    (RegistryError, "registry_error"),
    (ConsensusError, "consensus"),
)


def fallback_reason(error: BaseException) -> str:
    """The :data:`FALLBACK_REASONS` code for an error that made a peer load fall back."""
    for cls, reason in _REASON_BY_ERROR:
        if isinstance(error, cls):
            return reason
    return "other"
