"""nccl_back: receive model weights from a live peer instead of cloud storage."""

from .config import Settings
from .errors import NcclBackError

__all__ = ["NcclBackError", "Settings"]
__version__ = "0.1.0"
