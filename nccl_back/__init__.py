"""nccl_back: receive model weights from a live peer instead of cloud storage."""

from .config import Settings
from .errors import NcclBackError
from .handoff import HandoffServer, attach
from .identity import ModelSpec, Shard
from .loader import load_from_storage

__all__ = ["HandoffServer", "ModelSpec", "NcclBackError", "Settings", "Shard", "attach", "load_from_storage"]
__version__ = "0.1.0"
