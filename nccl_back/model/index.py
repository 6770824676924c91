"""The safetensors shard index (``model.safetensors.index.json``).

Kept apart from :mod:`nccl_back.model.checkpoint` because it needs no torch: computing a
model's identity (``nccl-back fingerprint``) reads the index and must stay fast.
"""

from __future__ import annotations

from nccl_back import bounded_json
from nccl_back.errors import CheckpointFormatError

INDEX_NAME = "model.safetensors.index.json"

#: Largest index file read (an index of 100,000 tensors is a few MiB).
MAX_INDEX_BYTES = 64 << 20


def parse_index(data: bytes, uri: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a safetensors index."""
    try:
        raw = bounded_json.loads(data, max_bytes=MAX_INDEX_BYTES)
        weight_map = raw["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map must map tensor names to file names")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointFormatError(f"{uri}: malformed index: {e!r}") from e
    for filename in set(weight_map.values()):
        # Shards live next to the index; a path would let an index point anywhere.
        if "/" in filename or filename in ("", ".", ".."):
            raise CheckpointFormatError(f"{uri}: shard name {filename!r} is not a plain file name")
    return weight_map
