"""The relay's records: cohorts of receivers seated in arrival order, and streamed downloads.

A cohort (a hash ``{n, epoch}`` living one window) seats each arrival at the next
position of its seat list (the key kind keeps the name ``chain``: its wire format), member
records signed for the cohort key, seat and record in one step (the join script). The
topology built on them is :mod:`nccl_back.transport.relay`.
"""

from __future__ import annotations

import uuid
from typing import Any

from nccl_back.coord import schema
from nccl_back.coord.records import Member
from nccl_back.coord.schema import KeyKind
from nccl_back.coord.signed_store import WRONG_TYPE, SignedStore, ms
from nccl_back.errors import RegistryError, UntrustedRecordError


class CohortRecords(SignedStore):
    """The cohort, chain and download-stream record families."""

    def join_cohort(
        self, version: str, rank: int, world_size: int, manifest_digest: str,
        member: dict[str, Any], *, window: float, max_size: int, ttl: float,
    ) -> tuple[str, int]:
        """Append ``member`` to the current cohort's chain: ``(chain key, position)``."""
        key = self.keys.of(schema.COHORT, version, rank, world_size, manifest_digest)
        record = self.signed(key, member, schema.CHAIN, ttl)  # bound to the cohort
        got = self._call("join_cohort", lambda: self.lua.join_cohort(
            keys=[key], args=[uuid.uuid4().hex[:12], ms(window), max(int(max_size), 1),
                              str(record), ms(ttl)]))
        try:
            chain, position = got
            return chain.decode("ascii"), int(position)
        except (TypeError, ValueError, AttributeError) as e:
            raise RegistryError(f"join_cohort: unexpected reply {got!r}"[:200]) from e

    def chain_members(self, chain: str, first: int, last: int) -> list[Member | None]:
        """Member records at positions ``first..last`` of ``chain`` (None where untrusted)."""
        cohort = self.keys.cohort_of_chain(chain)
        raws = self.items(chain, schema.CHAIN, first, last)
        if raws is WRONG_TYPE:  # garbage: no seat of this chain can be trusted
            raise RegistryError(f"{chain}: WRONGTYPE, not a chain of member records")
        return [self.parse(chain, raw, schema.CHAIN, signed_for=cohort) for raw in raws]

    def chain_size(self, chain: str) -> int:
        """How many members ``chain`` seated so far (a cohort's trees are built over them)."""
        self.keys.cohort_of_chain(chain)  # a chain key of this namespace, or RegistryError
        got = self._call("LLEN", lambda: self.client.llen(chain))
        if not isinstance(got, int) or isinstance(got, bool) or got < 0:
            raise RegistryError(f"LLEN {chain}: unexpected reply {got!r}"[:200])
        return got

    def mark_gone(self, member_id: str, ttl: float) -> None:
        """Say that ``member_id``'s relay endpoint has stopped, so members seated behind it
        skip it instead of waiting out a handshake."""
        self.set_signed(self.keys.of(schema.GONE, member_id), {"member_id": member_id},
                        schema.GONE, ttl)

    def _records_at(self, keys: list[str], kind: KeyKind) -> list[Any]:
        """The typed records at ``keys``, in one batch: None where absent or rejected."""
        return [None if raw is None else self.parse(key, raw, kind)
                for key, raw in zip(keys, self.values(keys, kind), strict=True)]

    def gone_members(self, member_ids: list[str]) -> set[str]:
        """Which of ``member_ids`` said their endpoint stopped (untrusted tombstones skipped)."""
        found = self._records_at([self.keys.of(schema.GONE, m) for m in member_ids], schema.GONE)
        return {m for m in found if m is not None}

    def put_verdict(self, member_id: str, ok: bool, ttl: float) -> None:
        """Say whether ``member_id``'s own check passed: it forwards before checking, so on
        a failure its receivers look further up."""
        self.set_signed(self.keys.of(schema.VERDICT, member_id), {"member_id": member_id, "ok": ok},
                        schema.VERDICT, ttl)

    def verdicts(self, member_ids: list[str]) -> dict[str, bool]:
        """The verdicts of those of ``member_ids`` that wrote one (untrusted ones skipped)."""
        found = self._records_at([self.keys.of(schema.VERDICT, m) for m in member_ids],
                                 schema.VERDICT)
        return {m: ok for m, ok in zip(member_ids, found, strict=True) if ok is not None}

    def mark_alive(self, member_id: str, ttl: float) -> None:
        """Say that ``member_id``'s relay endpoint serves, for ``ttl`` seconds."""
        self.set_signed(self.keys.of(schema.ALIVE, member_id), {"member_id": member_id},
                        schema.ALIVE, ttl)

    def lapsed(self, member_id: str) -> bool:
        """Whether ``member_id``'s liveness mark is gone (an untrusted one: not lapsed)."""
        try:
            return self.read(self.keys.of(schema.ALIVE, member_id), schema.ALIVE) is None
        except UntrustedRecordError:
            return False

    # -- downloads streamed to waiting workers ------------------------------------------

    def put_stream(self, version: str, rank: int, world_size: int, manifest_digest: str,
                   member: dict[str, Any], ttl: float) -> None:
        """Announce (signed, with a TTL) the relay endpoint a download is streamed from."""
        self.set_signed(self.keys.of(schema.STREAM, version, rank, world_size, manifest_digest),
                        member, schema.STREAM, ttl)

    def get_stream(self, version: str, rank: int, world_size: int,
                   manifest_digest: str) -> Member | None:
        """The verified stream record, or None."""
        return self.record(self.keys.of(schema.STREAM, version, rank, world_size, manifest_digest),
                           schema.STREAM)

    def drop_stream(self, version: str, rank: int, world_size: int, manifest_digest: str,
                    member_id: str) -> None:
        """Remove the stream record if it is still ours (a new downloader's stays)."""
        key = self.keys.of(schema.STREAM, version, rank, world_size, manifest_digest)
        got = self.get_signed(key, schema.STREAM)
        if got is not None and got[0].member_id == member_id:
            self.compare_and_delete(key, got[1])
