"""Artifact sets' record family (compile caches that travel between peers).

A set's manifest under its lookup key (the newest publisher wins: its holder is live),
and per model the lookup key and named factors of the newest set, so a miss can say
which factor differs (a compile setting, vLLM or torch version).
"""

from __future__ import annotations

from nccl_back.coord import schema
from nccl_back.coord.content import ArtifactIndex, ArtifactSetRecord, hex_token
from nccl_back.coord.signed_store import SignedStore

__all__ = ["ArtifactIndex", "ArtifactRecords", "ArtifactSetRecord"]


class ArtifactRecords(SignedStore):
    """Artifact set manifests and the per-model index."""

    def put_artifact_set(self, record: ArtifactSetRecord, scope: str,
                         factors: dict[str, str]) -> None:
        """Store ``record`` under its lookup key and make it ``scope``'s newest set."""
        hex_token(record.lookup, "lookup")
        hex_token(scope, "scope")
        self.set_signed(self.keys.of(schema.ARTIFACT_SET, record.lookup), record.to_json(),
                        schema.ARTIFACT_SET)
        self.set_signed(self.keys.of(schema.ARTIFACT_INDEX, scope),
                        {"lookup": record.lookup, "factors": factors}, schema.ARTIFACT_INDEX)

    def get_artifact_set(self, lookup: str) -> ArtifactSetRecord | None:
        """The set published under ``lookup``; None if absent or rejected."""
        return self.record(self.keys.of(schema.ARTIFACT_SET, hex_token(lookup, "lookup")),
                           schema.ARTIFACT_SET)

    def get_artifact_index(self, scope: str) -> ArtifactIndex | None:
        """``scope``'s newest set's lookup key and factors; None if absent or rejected."""
        return self.record(self.keys.of(schema.ARTIFACT_INDEX, hex_token(scope, "scope")),
                           schema.ARTIFACT_INDEX)
