"""The user-facing offload API."""

from hyperpar.offload.api.config import OffloadConfig
from hyperpar.offload.api.session import OffloadSession
from hyperpar.offload.api.skip_offload import skip_offload

__all__ = ["OffloadConfig", "OffloadSession", "skip_offload"]
