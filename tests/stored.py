"""What a Redis key holds, as the tests inspect it (the library reads through the schema)."""

from __future__ import annotations

import json
from typing import Any

from nccl_back.coord.registry import Registry


def stored_json(registry: Registry, key: str) -> Any:
    """The JSON value at ``key`` as stored (signature fields included), or None."""
    raw = registry.client.get(key)
    return None if raw is None else json.loads(raw)
