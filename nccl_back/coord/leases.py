"""The single-flight download lease: which one worker downloads a version from storage.

One per worker (taken by its rank 0), never one per rank; renewed by re-signing it with
a compare-and-set on the exact value its owner wrote, so after an expiry a late renewal
or release never takes it from its new owner. An untrusted lease is never obeyed: the
next taker takes it over atomically (:meth:`SignedStore.acquire`). The policy is
:mod:`.election`.

Beside it, the cooperative download's records: the download group (waiters in arrival
order), the roster the elected worker names, each member's announcement of where it
serves its part (read only by the elected worker: nobody else finds a partial holder),
and the rescues spreading a failed member's part over the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from nccl_back.coord import schema
from nccl_back.coord.records import Member, Rescue, Roster
from nccl_back.coord.signed_store import WRONG_TYPE, Raw, SignedStore, ms
from nccl_back.errors import RecordKind, UntrustedRecordError

#: Entries kept in a download group's list (the newest): a flood cannot grow it.
MAX_GROUP_ENTRIES = 256


class LeaseRecords(SignedStore):
    """The download-lease record family."""

    def take_lease(self, version: str, world_size: int, owner: str, ttl: float) -> Raw | None:
        """Take the lease for ``ttl`` seconds if nobody trusted holds it: the raw value
        stored (for renewal and release), or None."""
        return self.acquire(self.keys.of(schema.LEASE, version, world_size), {"owner": owner},
                            schema.LEASE, ttl)

    def lease_holder(self, version: str, world_size: int, ttl: float) -> str | None:
        """The owner of the lease now, or None (also for an untrusted value)."""
        got = self.record(self.keys.of(schema.LEASE, version, world_size), schema.LEASE, ttl=ttl)
        return None if got is None else str(got)

    def renew_lease(self, version: str, world_size: int, owner: str, held: Raw,
                    ttl: float) -> Raw | None:
        """Re-sign the lease for another ``ttl`` seconds if it still holds ``held``: the new
        raw value, or None if it is no longer ours."""
        key = self.keys.of(schema.LEASE, version, world_size)
        new = self.signed(key, {"owner": owner}, schema.LEASE, ttl)
        return new if self.compare_and_set(key, held, new, ttl) else None

    def drop_lease(self, version: str, world_size: int, held: Raw) -> bool:
        """Delete the lease if it still holds ``held`` (a new owner's stays)."""
        return self.compare_and_delete(self.keys.of(schema.LEASE, version, world_size), held)

    def join_download_group(self, version: str, world_size: int, worker: str) -> None:
        """Say that ``worker`` waits for ``version`` with the others of its group."""
        key = self.keys.of(schema.DOWNLOAD_GROUP, version, world_size)
        raw = self.signed(key, {"worker": worker}, schema.DOWNLOAD_GROUP)
        ttl = schema.DOWNLOAD_GROUP.ttl(self.settings)
        self._call("join_download_group", lambda: self.lua.push(
            keys=[key], args=[raw, MAX_GROUP_ENTRIES, ms(ttl)]))

    def download_group(self, version: str, world_size: int) -> list[str]:
        """The workers waiting for ``version``, each once, in arrival order."""
        key = self.keys.of(schema.DOWNLOAD_GROUP, version, world_size)
        raws = self.items(key, schema.DOWNLOAD_GROUP, 0, MAX_GROUP_ENTRIES - 1)
        if raws is WRONG_TYPE:
            self.reject(RecordKind.DOWNLOAD_GROUP, key, "wrong Redis type")
            return []
        workers: list[str] = []
        for raw in raws:
            got = self.parse(key, raw, schema.DOWNLOAD_GROUP)
            if got is not None and got not in workers:
                workers.append(got)
        return workers

    def name_download_roster(self, version: str, world_size: int, members: list[str]) -> None:
        """Name the members of ``version``'s cooperative download (the caller first)."""
        key = self.keys.of(schema.DOWNLOAD_ROSTER, version, world_size)
        self.set_signed(key, {"members": members}, schema.DOWNLOAD_ROSTER)

    def download_roster(self, version: str, world_size: int) -> Roster | None:
        """The roster of ``version``'s cooperative download, or None (also if untrusted)."""
        return self.record(self.keys.of(schema.DOWNLOAD_ROSTER, version, world_size),
                           schema.DOWNLOAD_ROSTER)

    def announce_download_member(self, version: str, rank: int, world_size: int, member: int,
                                 record: Member) -> None:
        """Say where member ``member`` of ``version``'s cooperative download serves its part."""
        key = self.keys.of(schema.DOWNLOAD_MEMBER, version, rank, world_size, member)
        self.set_signed(key, record.to_dict(), schema.DOWNLOAD_MEMBER)

    def download_member(self, version: str, rank: int, world_size: int, member: int) -> Member | None:
        """Where member ``member`` serves its part, or None (also if untrusted)."""
        return self.record(self.keys.of(schema.DOWNLOAD_MEMBER, version, rank, world_size, member),
                           schema.DOWNLOAD_MEMBER)

    def download_member_lapsed(self, version: str, rank: int, world_size: int, member: int,
                               endpoint: str) -> bool:
        """Whether member ``member``'s announcement is gone or names another endpoint than
        ``endpoint``; an untrusted value says neither (its renewal overwrites it), so a
        forged one never sends a live member's part back to storage."""
        try:
            got = self.read(self.keys.of(schema.DOWNLOAD_MEMBER, version, rank, world_size, member),
                            schema.DOWNLOAD_MEMBER)
        except UntrustedRecordError:
            return False
        return got is None or got[0].member_id != endpoint

    def spread_download_parts(self, version: str, rank: int, world_size: int,
                              rescues: Sequence[Rescue]) -> None:
        """Say which members read which failed members' parts (this rank's)."""
        self.set_signed(self.keys.of(schema.DOWNLOAD_RESCUE, version, rank, world_size),
                        {"rescues": [{"part": r.part, "by": list(r.by)} for r in rescues]},
                        schema.DOWNLOAD_RESCUE)

    def download_rescues(self, version: str, rank: int, world_size: int) -> tuple[Rescue, ...]:
        """The failed members' parts spread so far, or none (also if untrusted)."""
        return self.record(self.keys.of(schema.DOWNLOAD_RESCUE, version, rank, world_size),
                           schema.DOWNLOAD_RESCUE) or ()
