"""Redis key names: every coordination key is built (and every key name parsed) here,
from the record schema's kinds (:mod:`.schema`: a kind's prefix and parts, in order).

Every key lives under ``{namespace}:``, a hash tag, so on a Redis Cluster a whole
namespace sits in one slot (multi-key commands and Lua scripts need that). A cohort's
chains are ``{cohort}:{epoch}:{chain}``, named inside the join script. :meth:`Keys.of`
also builds ``SCAN`` globs (pass :data:`ANY` for a part; :meth:`Registry.publish_peer`
refuses glob characters in ids), so a glob and its keys are spelled by the same method.
"""

from __future__ import annotations

from nccl_back.coord import schema as K
from nccl_back.errors import RegistryError

#: Any value of one key part, in a ``SCAN`` glob.
ANY = "*"


class Keys:
    """The key names of one namespace (a value: cheap, immutable, shared by threads)."""

    def __init__(self, namespace: str) -> None:
        self._tag = "{" + namespace + "}"

    def key(self, *parts: object) -> str:
        """``{namespace}:part1:part2...`` (parts joined as ``str``)."""
        return ":".join([self._tag, *(str(p) for p in parts)])

    def of(self, kind: K.KeyKind, *parts: object) -> str:
        """The key of ``kind`` with ``parts``: one per :attr:`~.schema.KeyKind.parts`."""
        if len(parts) != len(kind.parts):
            raise ValueError(f"a {kind.name} key has the parts {kind.parts}, got {parts!r}"[:200])
        return self.key(kind.prefix, *parts)

    def peer_parts(self, key: str) -> tuple[str, str, str, str]:
        """``(version, rank, world_size, peer_id)`` of a peer key, as the strings in it."""
        _, _, version, rank, world, peer_id = key.rsplit(":", 5)
        return version, rank, world, peer_id

    def cohort_of_chain(self, chain: str) -> str:
        """The cohort key a chain key belongs to (its records are signed for it);
        :class:`RegistryError` if ``chain`` is no cohort chain of this namespace."""
        if not chain.startswith(self.key(K.COHORT.prefix, "")):
            raise RegistryError(f"{chain!r} is not a cohort chain key")
        return chain.rsplit(":", 2)[0]

    @staticmethod
    def chain_place(chain: str) -> list[str]:
        """``[epoch, chain index]`` of a chain key: how a log line names a chain."""
        return chain.rsplit(":", 2)[-2:]
