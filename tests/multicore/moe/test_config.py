"""Constructor validation: every bad value is rejected before allocation, naming argument and value."""

from __future__ import annotations

import math

import pytest

from hyperpar.multicore.moe import MoeExperts, MoeExpertsConfig

GOOD = dict(local_num_tokens=8, hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)


@pytest.mark.parametrize(("change", "error", "text"), [
    (dict(local_num_tokens=0), ValueError, "local_num_tokens must be a positive int, got 0"),
    (dict(hidden_size=True), TypeError, "hidden_size must be a positive int, got bool True"),
    (dict(intermediate_size=2.0), TypeError, "intermediate_size must be a positive int, got float 2.0"),
    (dict(num_experts=-4), ValueError, "num_experts must be a positive int, got -4"),
    (dict(top_k=5), ValueError, "top_k=5 must not exceed num_experts=4"),
    (dict(ep_size=3), ValueError, "num_experts=4 must be divisible by ep_size=3"),
    (dict(swiglu_limit=0.0), ValueError, "swiglu_limit must be None or a finite number > 0, got 0.0"),
    (dict(swiglu_limit=math.inf), ValueError, "swiglu_limit must be None or a finite number > 0, got inf"),
    (dict(swiglu_limit=True), TypeError, "swiglu_limit must be None or a real number, got bool True"),
    (dict(expert_capacity_factor=0.5), ValueError,
     "expert_capacity_factor must be None or a finite number >= 1"),
    (dict(expert_capacity_factor=math.nan), ValueError, "got nan"),
    (dict(create_parameters=1), TypeError, "create_parameters must be a bool, got int 1"),
    (dict(overlap_chunks=0), ValueError, "overlap_chunks must be a positive int, got 0"),
])
def test_bad_values_are_rejected(change: dict, error: type, text: str) -> None:
    with pytest.raises(error, match=text.replace("[", r"\[").replace("(", r"\(")):
        MoeExperts(**{**GOOD, **change})


def test_expert_parallel_without_distributed_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"ep_size=2 needs torch\.distributed"):
        MoeExperts(**GOOD, ep_size=2)


def test_capacity_rows() -> None:
    assert MoeExpertsConfig(**GOOD, ep_size=2).capacity_rows == 2 * 8 * 2  # lossless
    bounded = MoeExpertsConfig(**GOOD, ep_size=2, expert_capacity_factor=1.3)
    assert bounded.capacity_rows == math.ceil(16 * 1.3)
    assert MoeExpertsConfig(**GOOD, expert_capacity_factor=9.0).capacity_rows == 16  # never above lossless


def test_parameters_layout() -> None:
    layer = MoeExperts(**GOOD)
    assert tuple(layer.gate_up_weight.shape) == (4, 16, 16)
    assert tuple(layer.down_weight.shape) == (4, 8, 16)
    bound = math.sqrt(6 / (16 + 16))
    assert float(layer.gate_up_weight.detach().abs().max()) <= bound
    assert float(layer.gate_up_weight.detach().std()) > 0.1 * bound
    external = MoeExperts(**GOOD, create_parameters=False)
    assert external.gate_up_weight is None and list(external.parameters()) == []
    layer.close()
    external.close()


def test_ep_group_must_be_a_process_group() -> None:
    with pytest.raises(TypeError, match=r"ep_group must be None or a torch\.distributed ProcessGroup"):
        MoeExperts(**GOOD, ep_group="world")
