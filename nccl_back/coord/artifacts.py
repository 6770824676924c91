"""Artifact sets' record family (compile caches that travel between peers).

- ``ns:art:{k}``: the manifest of the set published under lookup key ``k`` (a hex
  digest of what the engine knows before it compiles, :mod:`nccl_back.load.artifacts`)
  and the version its holders serve it as; signed, written by every publisher (the
  newest wins: its holder is live), TTL :data:`ARTIFACT_TTL_FACTOR` x ``peer_ttl``.
- ``ns:artidx:{s}``: for one model (``s``: its weights' version), the lookup key and
  the named factors of the newest set published, so a miss can say which factor
  differs (another compile setting, vLLM or torch version).

Both are read as untrusted input: signed for their key, bounded, parsed into
:class:`ArtifactSetRecord` / :class:`ArtifactIndex` or rejected (logged, counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from nccl_back.coord.store import SignedStore
from nccl_back.errors import ArtifactError, RecordKind, UntrustedRecordError
from nccl_back.model.artifacts import ArtifactManifest, parse_manifest

#: Records live this many ``peer_ttl``: a set outlives its holder a while (a miss then
#: says that no live peer holds it), and the next publisher replaces it.
ARTIFACT_TTL_FACTOR = 360
#: Largest manifest record (MAX_FILES paths of up to MAX_PATH_CHARS).
MAX_ARTIFACT_RECORD_BYTES = 8 << 20
#: Most factors in an index record, and the longest name or value.
MAX_FACTORS = 32
MAX_FACTOR_CHARS = 200


def _hex(value: object, what: str) -> str:
    if not isinstance(value, str) or not 8 <= len(value) <= 64 or \
            any(c not in "0123456789abcdef" for c in value):
        raise UntrustedRecordError(f"{what} must be 8 to 64 hex characters")
    return value


@dataclass(frozen=True)
class ArtifactSetRecord:
    """A published set: under which lookup key, served as which version, what it holds."""

    lookup: str
    version: str
    manifest: ArtifactManifest

    def to_json(self) -> dict[str, object]:
        return {"lookup": self.lookup, "version": self.version, "manifest": self.manifest.to_json()}

    @classmethod
    def parse(cls, data: dict[str, object], lookup: str, max_bytes: int) -> ArtifactSetRecord:
        if data.get("lookup") != lookup:
            raise UntrustedRecordError("an artifact set record of another lookup key")
        try:
            manifest = parse_manifest(data.get("manifest"), max_bytes)
        except ArtifactError as e:
            raise UntrustedRecordError(str(e)) from e
        return cls(lookup, _hex(data.get("version"), "version"), manifest)


@dataclass(frozen=True)
class ArtifactIndex:
    """The newest set of one model: its lookup key and the factors it was derived from."""

    lookup: str
    factors: dict[str, str]

    @classmethod
    def parse(cls, data: dict[str, object]) -> ArtifactIndex:
        factors = data.get("factors")
        if not isinstance(factors, dict) or len(factors) > MAX_FACTORS or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_FACTOR_CHARS
                and len(v) <= MAX_FACTOR_CHARS for k, v in factors.items()):
            raise UntrustedRecordError("factors must be a bounded object of strings")
        return cls(_hex(data.get("lookup"), "lookup"), dict(factors))


class ArtifactRecords(SignedStore):
    """Artifact set manifests and the per-model index."""

    @property
    def _artifact_ttl(self) -> float:
        return self.settings.peer_ttl * ARTIFACT_TTL_FACTOR

    def put_artifact_set(self, record: ArtifactSetRecord, scope: str,
                         factors: dict[str, str]) -> None:
        """Store ``record`` under its lookup key and make it ``scope``'s newest set."""
        _hex(record.lookup, "lookup")
        _hex(scope, "scope")
        self.set_signed(self.keys.artifact_set(record.lookup), record.to_json(), self._artifact_ttl)
        self.set_signed(self.keys.artifact_index(scope),
                        {"lookup": record.lookup, "factors": factors}, self._artifact_ttl)

    def get_artifact_set(self, lookup: str) -> ArtifactSetRecord | None:
        """The set published under ``lookup``; None if absent or rejected."""
        key = self.keys.artifact_set(_hex(lookup, "lookup"))
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is None:
            return None
        try:
            if not isinstance(raw, (str, bytes)):
                raise UntrustedRecordError("wrong Redis type")
            value = self.verify(key, raw, RecordKind.ARTIFACT_SET, ttl_ms, MAX_ARTIFACT_RECORD_BYTES)
            return ArtifactSetRecord.parse(value, lookup, self.settings.max_artifact_bytes)
        except UntrustedRecordError as e:
            self.reject(RecordKind.ARTIFACT_SET, key, str(e))
            return None

    def get_artifact_index(self, scope: str) -> ArtifactIndex | None:
        """``scope``'s newest set's lookup key and factors; None if absent or rejected."""
        key = self.keys.artifact_index(_hex(scope, "scope"))
        got = self.get_signed(key, RecordKind.ARTIFACT_SET)
        if got is None:
            return None
        try:
            return ArtifactIndex.parse(got[0])
        except UntrustedRecordError as e:
            self.reject(RecordKind.ARTIFACT_SET, key, str(e))
            return None
