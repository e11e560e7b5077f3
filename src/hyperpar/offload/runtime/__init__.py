"""Runtime: where activation bytes live (device or host) and how they move."""

from hyperpar.offload.runtime.bandwidth import measure_bandwidth_gbps
from hyperpar.offload.runtime.copy_engine import CopyEngine, SyncCopyEngine
from hyperpar.offload.runtime.host_pool import HostPool
from hyperpar.offload.runtime.residency_manager import ResidencyManager, StorageEntry

__all__ = [
    "CopyEngine",
    "HostPool",
    "ResidencyManager",
    "StorageEntry",
    "SyncCopyEngine",
    "measure_bandwidth_gbps",
]
