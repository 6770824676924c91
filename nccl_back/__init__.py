"""nccl_back: receive model weights from a live peer instead of cloud storage.

The public names are imported on first use (PEP 562), so ``import nccl_back`` and the
metadata commands of the CLI stay fast: only what needs tensors imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nccl_back.caches.compile_cache import compile_cache
    from nccl_back.config import Settings
    from nccl_back.errors import NcclBackError
    from nccl_back.load.service import WeightService
    from nccl_back.model.identity import ModelSpec, Shard
    from nccl_back.model.layout import Padding, column, concat, row, shard
    from nccl_back.model.loader import load_from_storage
    from nccl_back.model.pipeline import assemble, pipeline_skeletons
    from nccl_back.model.sharding import Sharding, sharding
    from nccl_back.model.skeleton import build as build_skeleton
    from nccl_back.result import LoadResult
    from nccl_back.sidecar.handoff import HandoffServer, attach

#: public name -> module that defines it (``module:name`` where the name differs there)
_EXPORTS = {
    "HandoffServer": "sidecar.handoff",
    "LoadResult": "result",
    "ModelSpec": "model.identity",
    "NcclBackError": "errors",
    "Padding": "model.layout",
    "Settings": "config",
    "Shard": "model.identity",
    "Sharding": "model.sharding",
    "WeightService": "load.service",
    "assemble": "model.pipeline",
    "attach": "sidecar.handoff",
    "build_skeleton": "model.skeleton:build",
    "compile_cache": "caches.compile_cache",
    "column": "model.layout",
    "concat": "model.layout",
    "load_from_storage": "model.loader",
    "pipeline_skeletons": "model.pipeline",
    "row": "model.layout",
    "shard": "model.layout",
    "sharding": "model.sharding",
}

__all__ = [
    "HandoffServer",
    "LoadResult",
    "ModelSpec",
    "NcclBackError",
    "Padding",
    "Settings",
    "Shard",
    "Sharding",
    "WeightService",
    "assemble",
    "attach",
    "build_skeleton",
    "column",
    "compile_cache",
    "concat",
    "load_from_storage",
    "pipeline_skeletons",
    "row",
    "shard",
    "sharding",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nccl_back' has no attribute {name!r}")
    module, _, attr = module.partition(":")
    value = getattr(importlib.import_module(f".{module}", __name__), attr or name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
