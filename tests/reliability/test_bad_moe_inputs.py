"""Bad MoeExperts constructor and forward arguments: a clear error naming the argument and the
value, and the layer still gives the right answer on the next good call."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyperpar.multicore.moe import MoeExperts

GOOD = dict(local_num_tokens=8, hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)
T, H, K, E = 6, 16, 2, 4

CONSTRUCTOR_CASES: list[tuple[dict[str, Any], type[Exception], str]] = [
    (dict(local_num_tokens=-1), ValueError, "local_num_tokens must be a positive int, got -1"),
    (dict(local_num_tokens="8"), TypeError, "local_num_tokens must be a positive int, got str '8'"),
    (dict(hidden_size=None), TypeError, "hidden_size must be a positive int, got NoneType None"),
    (dict(intermediate_size=0), ValueError, "intermediate_size must be a positive int, got 0"),
    (dict(num_experts=4.0), TypeError, "num_experts must be a positive int, got float 4.0"),
    (dict(top_k=0), ValueError, "top_k must be a positive int, got 0"),
    (dict(top_k=9), ValueError, "top_k=9 must not exceed num_experts=4"),
    (dict(ep_size=0), ValueError, "ep_size must be a positive int, got 0"),
    (dict(ep_size=2), ValueError, "ep_size=2 needs torch.distributed to be initialised"),
    (dict(expert_capacity_factor="2"), TypeError,
     "expert_capacity_factor must be None or a real number, got str"),
    (dict(expert_capacity_factor=-math.inf), ValueError,
     "expert_capacity_factor must be None or a finite number"),
    (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit must be None or a finite number > 0, got -1.0"),
    (dict(overlap_chunks=1.5), TypeError, "overlap_chunks must be a positive int, got float 1.5"),
    (dict(create_parameters="no"), TypeError, "create_parameters must be a bool, got str 'no'"),
]


@pytest.mark.parametrize(("change", "error", "text"), CONSTRUCTOR_CASES, ids=lambda v: None)
def test_constructor_rejects_bad_values(change: dict[str, Any], error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        MoeExperts(**{**GOOD, **change})
    assert text in str(info.value)


def test_an_ep_group_that_is_not_a_process_group_is_named() -> None:
    """Regression (found here, fixed by the MoE owner): it used to be ignored at ep_size=1."""
    with pytest.raises(TypeError) as info:
        MoeExperts(**GOOD, ep_group="world")
    assert "ep_group must be None or a torch.distributed ProcessGroup, got str 'world'" in str(info.value)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    return hidden, ids, weights


Call = Callable[[MoeExperts, torch.Tensor, torch.Tensor, torch.Tensor], Any]
FORWARD_CASES: list[tuple[str, Call, type[Exception], str]] = [
    ("hidden not a tensor", lambda m, h, i, w: m(h.tolist(), i, w), ValueError,
     "MoeExperts: hidden_states must be a torch.Tensor, got list"),
    ("hidden width", lambda m, h, i, w: m(h[:, :15], i, w), ValueError,
     "hidden_states must end in hidden_size=16, got shape [6, 15]"),
    ("hidden dtype", lambda m, h, i, w: m(h.double(), i, w), ValueError,
     "bound to device=cpu, dtype=torch.float32; got device=cpu, dtype=torch.float64"),
    ("too many tokens", lambda m, h, i, w: m(torch.cat([h, h]), torch.cat([i, i]), torch.cat([w, w])),
     ValueError, "12 tokens exceed local_num_tokens=8"),
    ("ids float", lambda m, h, i, w: m(h, i.float(), w), ValueError,
     "topk_ids must be an integer tensor, got dtype=torch.float32"),
    ("ids list", lambda m, h, i, w: m(h, i.tolist(), w), ValueError, "topk_ids must be a tensor"),
    ("ids shape", lambda m, h, i, w: m(h, i[:, :1], w), ValueError,
     "topk_ids must have shape [6, 2] (tokens, top_k), got [6, 1]"),
    ("ids too large", lambda m, h, i, w: m(h, i + E, w), ValueError,
     "topk_ids must lie in [0, 4), got values in"),
    ("ids negative", lambda m, h, i, w: m(h, i - E, w), ValueError,
     "topk_ids must lie in [0, 4), got values in [-"),
    ("weights int", lambda m, h, i, w: m(h, i, i), ValueError,
     "topk_weights must be a floating-point tensor"),
    ("weights shape", lambda m, h, i, w: m(h, i, w[:3]), ValueError,
     "topk_weights must have shape [6, 2], got [3, 2]"),
    ("weights None", lambda m, h, i, w: m(h, i, None), ValueError,
     "topk_weights must be a floating-point tensor"),
    ("tokens_per_expert counts", lambda m, h, i, w: m(h, i, w, tokens_per_expert=torch.tensor([3, 3, 3, 3])),
     ValueError, "tokens_per_expert=[3, 3, 3, 3] does not match the counts of topk_ids"),
    ("tokens_per_expert length", lambda m, h, i, w: m(h, i, w, tokens_per_expert=torch.tensor([12])),
     ValueError, "tokens_per_expert=[12] does not match"),
    ("tokens_per_expert list", lambda m, h, i, w: m(h, i, w, tokens_per_expert=[3, 3, 3, 3]), ValueError,
     "tokens_per_expert must be None or a tensor, got list"),
    ("tokens_per_expert float", lambda m, h, i, w: m(h, i, w, tokens_per_expert=torch.bincount(
        i.flatten(), minlength=E).float() + 0.25), ValueError,
     "tokens_per_expert must be an integer tensor (counts), got dtype=torch.float32"),
    ("expert_weights given", lambda m, h, i, w: m(h, i, w, expert_weights=(m.gate_up_weight, m.down_weight)),
     ValueError, "expert_weights must be None when create_parameters=True"),
]


@pytest.mark.parametrize(("name", "call", "error", "text"), FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_rejects_bad_arguments_and_recovers(name: str, call: Call, error: type[Exception],
                                                    text: str) -> None:
    torch.manual_seed(0)
    layer = MoeExperts(**GOOD)
    twin = MoeExperts(**GOOD)
    twin.load_state_dict(layer.state_dict())
    hidden, ids, weights = _inputs()
    if name != "hidden not a tensor":
        layer(hidden, ids, weights)  # bound: later mistakes are caught on a bound layer
    with pytest.raises(error) as info:
        call(layer, hidden, ids, weights)
    assert text in str(info.value)
    out = layer(hidden, ids, weights)
    out.sum().backward()
    expected = twin(hidden, ids, weights)
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert torch.equal(layer.gate_up_weight.grad, twin.gate_up_weight.grad)
    layer.close()
    twin.close()


EXTERNAL_CASES: list[tuple[str, Any, type[Exception], str]] = [
    ("missing", None, ValueError,
     "create_parameters=False needs expert_weights=(gate_up_weight, down_weight), got NoneType"),
    ("one tensor", (torch.zeros(4, 16, 16),), ValueError,
     "needs expert_weights=(gate_up_weight, down_weight)"),
    ("gate_up shape", (torch.zeros(4, 16, 8), torch.zeros(4, 8, 16)), ValueError,
     "gate_up_weight must have shape [4, 16, 16], got [4, 16, 8]"),
    ("down dtype", (torch.zeros(4, 16, 16), torch.zeros(4, 8, 16, dtype=torch.float64)), ValueError,
     "down_weight is torch.float64 on cpu but hidden_states is torch.float32 on cpu"),
]


@pytest.mark.parametrize(("name", "weights", "error", "text"), EXTERNAL_CASES,
                         ids=[c[0] for c in EXTERNAL_CASES])
def test_external_expert_weights_are_checked(name: str, weights: Any, error: type[Exception],
                                             text: str) -> None:
    layer = MoeExperts(**GOOD, create_parameters=False)
    hidden, ids, topk_weights = _inputs()
    with pytest.raises(error) as info:
        layer(hidden, ids, topk_weights, expert_weights=weights)
    assert text in str(info.value)
    layer.close()


def test_a_rejected_first_call_binds_nothing() -> None:
    """Issue 14: a bfloat16 input to a float32 layer as its first call bound it to bfloat16, so every
    later float32 call failed."""
    layer = MoeExperts(**GOOD)
    hidden, ids, weights = _inputs()
    with pytest.raises(ValueError) as info:
        layer(hidden.bfloat16(), ids, weights.bfloat16())
    assert "gate_up_weight is torch.float32 on cpu but hidden_states is torch.bfloat16" in str(info.value)
    assert layer.binding_id is None
    with torch.no_grad():
        out = layer(hidden, ids, weights)
    assert out.dtype == torch.float32 and layer._resource_group.dtype == torch.float32
    layer.close()
