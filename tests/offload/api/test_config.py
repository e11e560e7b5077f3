from __future__ import annotations

import math

import pytest
import torch

from hyperpar.offload import OffloadConfig
from hyperpar.offload.planning import GreedyPlanner, TimedPlanner

BAD = [
    ({"max_resident_activation_mb": -1}, ValueError, "max_resident_activation_mb"),
    ({"max_resident_activation_mb": math.nan}, ValueError, "max_resident_activation_mb"),
    ({"max_resident_activation_mb": math.inf}, ValueError, "max_resident_activation_mb"),
    ({"max_resident_activation_mb": "512"}, TypeError, "max_resident_activation_mb"),
    ({"max_resident_activation_mb": True}, TypeError, "max_resident_activation_mb"),
    ({"max_offload_activation_mb": -0.5}, ValueError, "max_offload_activation_mb"),
    ({"max_offload_activation_mb": math.inf}, ValueError, "max_offload_activation_mb"),
    ({"max_offload_activation_mb": None}, TypeError, "max_offload_activation_mb"),
    ({"planner": "fastest"}, ValueError, "planner"),
    ({"planner": 3}, TypeError, "planner"),
    ({"device": "nonsense"}, ValueError, "device"),
    ({"device": 0}, TypeError, "device"),
    ({"on_divergence": "ignore"}, ValueError, "on_divergence"),
    ({"verify": 1}, TypeError, "verify"),
]


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_values_name_the_field_and_value(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error) as info:
        OffloadConfig(**kwargs)
    assert field in str(info.value)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_defaults_and_accepted_values() -> None:
    cfg = OffloadConfig()
    assert cfg.max_resident_activation_mb == 1024 and cfg.max_offload_activation_mb == 65536
    assert cfg.budget_bytes == 1024 << 20
    assert cfg.resolved_device() == torch.device("cpu")  # CI has no accelerator
    assert OffloadConfig(device="cpu").resolved_device() == torch.device("cpu")
    assert OffloadConfig(device=torch.device("cpu")).resolved_device() == torch.device("cpu")
    assert OffloadConfig(max_resident_activation_mb=0).budget_bytes == 0
    assert OffloadConfig(max_resident_activation_mb=0.5).budget_bytes == 1 << 19
    assert isinstance(OffloadConfig().resolved_planner(), TimedPlanner)
    assert isinstance(OffloadConfig(planner="greedy").resolved_planner(), GreedyPlanner)
    planner = GreedyPlanner()
    assert OffloadConfig(planner=planner).resolved_planner() is planner
    with pytest.raises(AttributeError):
        cfg.planner = "timed"  # type: ignore[misc]
