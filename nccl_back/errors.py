"""The one error hierarchy of nccl_back: every error raised on purpose derives from
:class:`NcclBackError`; each class's docstring says when it is raised."""

from __future__ import annotations

import enum


class NcclBackError(Exception):
    """Root of every error nccl_back raises on purpose."""


class ConfigError(NcclBackError, ValueError):
    """A setting, flag, URL or environment variable has a bad value (the message says
    which, and how to fix it)."""


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
    """After a load, tensors were missing, unexpected or filled twice; or a checkpoint
    tensor does not fit its skeleton container (nccl_back never casts silently)."""


class WeightVerificationError(NcclBackError):
    """Integrity hashes computed after a load differ from the ground truth; ``bad`` names
    the layers (or checkpoint tensors) that differ."""

    def __init__(self, message: str, bad: set[str] | frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.bad = frozenset(bad)


class RegistryError(NcclBackError):
    """Redis, the coordination store, is unreachable or answered with something unexpected."""


class UntrustedRecordError(RegistryError):
    """A value read from Redis is not to be acted on (unsigned or badly signed under a
    secret, expired, malformed, out of bounds, kept without a TTL); it alone is skipped."""


class PeerError(NcclBackError):
    """A peer load could not be carried out; the subclasses say why. Triggers fallback."""


class NoPeerError(PeerError):
    """No live peer holds this version (for this rank), or every candidate was claimed."""


class BudgetSpentError(NoPeerError):
    """A phase of one load spent its time bound (:mod:`nccl_back.budget`) before a peer
    served it."""


class HandshakeTimeoutError(PeerError, TimeoutError):
    """The liveness handshake did not complete within its timeout; no communicator was made."""


class ManifestMismatchError(PeerError):
    """Sender and receiver disagree on the tensors to transfer (names, shapes or dtypes)."""


class TransferError(PeerError):
    """The transport failed while creating the communicator or moving data (peer crashed)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """The watchdog deadline passed during communicator creation or the broadcast loop
    (the communicator was aborted first)."""


class TransferStalledError(TransferTimeoutError):
    """No step of a transfer completed within its stall bound (a silent peer), long
    before the deadline (the communicator was aborted first)."""


class TransferAbandonedError(TransferError):
    """The sender gave the transfer up after the handshake (closing, past its drain's
    bound) and left a notice saying so (the communicator was aborted first)."""


class IncompatiblePeerError(PeerError):
    """The peers holding this version speak another transport or hold their weights on
    another device kind: raised at discovery, or on a sender's refusal."""


class LayoutMismatchError(IncompatiblePeerError):
    """This worker cannot reshard (its engine adapter could not describe its layout as
    pieces of the checkpoint): it loads only from peers of its exact layout, or storage."""


class ConsensusError(PeerError):
    """The worker's ranks could not agree: a collective over its group failed, or rank
    ``failed_rank`` failed and this one follows it (None: the group itself failed)."""

    def __init__(self, message: str, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class ArtifactError(NcclBackError):
    """An artifact set (compile caches) is refused (bad or oversized manifest, escaping
    path, wrong keyed digest, no secret) or could not be collected or installed; nothing
    of a refused set is written."""


class UntrustedPathError(ArtifactError):
    """A compile-cache path another local user could have written
    (:mod:`nccl_back.model.trusted_tree`): nothing under it is published or installed."""


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
    """``enum.StrEnum`` (Python 3.11) for 3.10: ``str(member) == member.value``."""

    def __str__(self) -> str:
        return self.value


class RecordKind(StrEnum):
    """Every kind of value read from Redis and possibly rejected: the one list records,
    :meth:`Registry.reject`, metric labels and error messages share (each key kind's
    meaning is in :mod:`nccl_back.coord.schema`)."""

    PEER = "peer"
    INDEX = "index"
    GROUND_TRUTH = "ground_truth"
    REQUEST = "request"
    HANDSHAKE = "handshake"
    CLAIM = "claim"
    LEASE = "lease"
    DOWNLOAD_GROUP = "download_group"
    DOWNLOAD_ROSTER = "download_roster"
    DOWNLOAD_MEMBER = "download_member"
    DOWNLOAD_RESCUE = "download_rescue"
    COHORT_MEMBER = "cohort_member"
    DOWNLOAD_STREAM = "download_stream"
    LAYOUT = "layout"
    POSITION_TRUTH = "position_truth"
    GROUP = "group"
    GONE = "gone"
    ALIVE = "alive"
    VERDICT = "verdict"
    RENDEZVOUS = "rendezvous"
    ARTIFACT_SET = "artifact_set"
    ARTIFACT_INDEX = "artifact_index"


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
