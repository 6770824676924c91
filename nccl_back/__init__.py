"""nccl_back: receive model weights from a live peer instead of cloud storage."""

from .config import Settings
from .errors import NcclBackError
from .handoff import HandoffServer, attach
from .identity import ModelSpec, Shard
from .loader import load_from_storage
from .result import LoadResult
from .service import WeightService

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
