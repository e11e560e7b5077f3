"""Expert-parallel routed MoE experts on the multicore lifecycle layer."""

from .config import MoeExpertsConfig
from .grouped_gemm import set_grouped_mm_enabled
from .module import MoeExperts
from .reference import dense_moe_reference
from .workspace import MoeWorkspace, WorkspaceSpec

__all__ = ["MoeExperts", "MoeExpertsConfig", "MoeWorkspace", "WorkspaceSpec", "dense_moe_reference",
           "set_grouped_mm_enabled"]
