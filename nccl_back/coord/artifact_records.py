"""Artifact sets' record family (compile caches that travel between peers).

- ``ns:art:{k}``: the manifest of the set published under lookup key ``k`` (a hex
  digest of what the engine knows before it compiles, :mod:`nccl_back.load.artifact_transfer`)
  and the version its holders serve it as; signed, written by every publisher (the
  newest wins: its holder is live).
- ``ns:artidx:{s}``: for one model (``s``: its weights' version), the lookup key and
  the named factors of the newest set published, so a miss can say which factor
  differs (another compile setting, vLLM or torch version).

Both are read as untrusted input through the record schema (:mod:`.schema`): signed
for their key, bounded, parsed into :class:`ArtifactSetRecord` / :class:`ArtifactIndex`
or rejected (logged, counted).
"""

from __future__ import annotations

from nccl_back.coord import schema
from nccl_back.coord.content import ArtifactIndex, ArtifactSetRecord, hex_token
from nccl_back.coord.schema import ARTIFACT_TTL_FACTOR
from nccl_back.coord.signed_store import SignedStore

__all__ = ["ARTIFACT_TTL_FACTOR", "ArtifactIndex", "ArtifactRecords", "ArtifactSetRecord"]


class ArtifactRecords(SignedStore):
    """Artifact set manifests and the per-model index."""

    def put_artifact_set(self, record: ArtifactSetRecord, scope: str,
                         factors: dict[str, str]) -> None:
        """Store ``record`` under its lookup key and make it ``scope``'s newest set."""
        hex_token(record.lookup, "lookup")
        hex_token(scope, "scope")
        self.set_signed(self.keys.artifact_set(record.lookup), record.to_json(), schema.ARTIFACT_SET)
        self.set_signed(self.keys.artifact_index(scope),
                        {"lookup": record.lookup, "factors": factors}, schema.ARTIFACT_INDEX)

    def get_artifact_set(self, lookup: str) -> ArtifactSetRecord | None:
        """The set published under ``lookup``; None if absent or rejected."""
        got = self.get_signed(self.keys.artifact_set(hex_token(lookup, "lookup")), schema.ARTIFACT_SET)
        return None if got is None else got[0]

    def get_artifact_index(self, scope: str) -> ArtifactIndex | None:
        """``scope``'s newest set's lookup key and factors; None if absent or rejected."""
        got = self.get_signed(self.keys.artifact_index(hex_token(scope, "scope")), schema.ARTIFACT_INDEX)
        return None if got is None else got[0]
