"""nccl_back: receive model weights from a live peer instead of cloud storage.

The public names are imported on first use (PEP 562), so ``import nccl_back`` and the
metadata commands of the CLI stay fast: only what needs tensors imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nccl_back.config import Settings
    from nccl_back.errors import NcclBackError
    from nccl_back.load.service import WeightService
    from nccl_back.model.identity import ModelSpec, Shard
    from nccl_back.model.loader import load_from_storage
    from nccl_back.result import LoadResult
    from nccl_back.sidecar.handoff import HandoffServer, attach

#: public name -> module that defines it
_EXPORTS = {
    "HandoffServer": "sidecar.handoff",
    "LoadResult": "result",
    "ModelSpec": "model.identity",
    "NcclBackError": "errors",
    "Settings": "config",
    "Shard": "model.identity",
    "WeightService": "load.service",
    "attach": "sidecar.handoff",
    "load_from_storage": "model.loader",
}

__all__ = [
    "HandoffServer",
    "LoadResult",
    "ModelSpec",
    "NcclBackError",
    "Settings",
    "Shard",
    "WeightService",
    "attach",
    "load_from_storage",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nccl_back' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
