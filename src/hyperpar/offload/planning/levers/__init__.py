"""The planner's choice between levers: keep, offload, recompute (issue 41)."""

from hyperpar.offload.planning.levers.recompute_choice import (
    RecomputeChoice,
    Region,
    choose_recompute,
    hideable_bytes,
    regions_of,
    worth_looking,
)

__all__ = ["RecomputeChoice", "Region", "choose_recompute", "hideable_bytes", "regions_of", "worth_looking"]
