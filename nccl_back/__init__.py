"""nccl_back: receive model weights from a live peer instead of cloud storage."""

from .config import Settings
from .errors import NcclBackError
from .identity import ModelSpec, Shard
from .loader import load_from_storage

__all__ = ["ModelSpec", "NcclBackError", "Settings", "Shard", "load_from_storage"]
__version__ = "0.1.0"
