"""Collectively owned execution resources and the expert-parallel MoeExperts layer."""

from hyperpar.multicore.cleanup import closing
from hyperpar.multicore.collective import (
    CollectiveError,
    CollectiveTypeError,
    CollectiveValueError,
    collective_call,
    exchange,
)
from hyperpar.multicore.manager import MANAGER, ResourceManager, close_groups, register_runtime_release
from hyperpar.multicore.module import MulticoreModule
from hyperpar.multicore.moe import MoeExperts
from hyperpar.multicore.resources import ExecutionResources, ResourceGroup

__all__ = [
    "MANAGER",
    "CollectiveError",
    "CollectiveTypeError",
    "CollectiveValueError",
    "ExecutionResources",
    "MoeExperts",
    "MulticoreModule",
    "ResourceGroup",
    "ResourceManager",
    "close_groups",
    "closing",
    "collective_call",
    "exchange",
    "register_runtime_release",
]
