"""Runtime: where activation bytes live (device or host) and how they move."""

from hyperpar.offload.runtime.bandwidth import LinkBandwidth, measure_bandwidth_gbps, probe_link
from hyperpar.offload.runtime.copy_engine import CopyEngine, CopySpan, SyncCopyEngine
from hyperpar.offload.runtime.engine_factory import make_copy_engine
from hyperpar.offload.runtime.host_pool import HostPool
from hyperpar.offload.runtime.op_timer import OpTimer
from hyperpar.offload.runtime.residency_manager import (
    HostCopyCorruptedError,
    ResidencyManager,
    RestoreError,
    StorageEntry,
)
from hyperpar.offload.runtime.thread_copy_engine import ThreadCopyEngine
from hyperpar.offload.runtime.timeline import StepTimeline

__all__ = [
    "CopyEngine",
    "CopySpan",
    "HostCopyCorruptedError",
    "HostPool",
    "LinkBandwidth",
    "OpTimer",
    "ResidencyManager",
    "RestoreError",
    "StepTimeline",
    "StorageEntry",
    "SyncCopyEngine",
    "ThreadCopyEngine",
    "make_copy_engine",
    "measure_bandwidth_gbps",
    "probe_link",
]
