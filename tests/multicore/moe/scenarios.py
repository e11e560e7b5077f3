"""Routing scenarios and the rank body that checks MoeExperts against the dense reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import hyperpar.multicore.moe.function as moe_function
from hyperpar.multicore.moe import MoeExperts, dense_moe_reference

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2
MAX_TOKENS = 16


def routing(scenario: str, tokens: int, rank: int, world: int, gen: torch.Generator) -> torch.Tensor:
    """topk_ids [tokens, TOP_K] with distinct experts per token."""
    local = EXPERTS // world
    if scenario == "uniform":
        pool = list(range(EXPERTS))
    elif scenario == "skewed":  # nearly everything to experts 0 and 1 (rank 0), a few to expert 5
        ids = torch.tensor([[0, 1]] * tokens)
        ids[::4, 1] = 5
        return ids
    elif scenario == "empty_experts":  # odd experts get no tokens anywhere
        pool = list(range(0, EXPERTS, 2))
    elif scenario == "single_destination":  # every row of every rank goes to the last rank
        pool = list(range(EXPERTS - local, EXPERTS))
    else:
        raise ValueError(scenario)
    if tokens == 0:
        return torch.zeros(0, TOP_K, dtype=torch.int64)
    choice = torch.stack([torch.randperm(len(pool), generator=gen)[:TOP_K] for _ in range(tokens)])
    return torch.tensor(pool)[choice]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


@contextmanager
def _recording_waves() -> Iterator[list[int]]:
    """The number of waves of every route plan built inside."""
    waves: list[int] = []
    plan_of_call = moe_function.build_route_plan

    def recording(*args: Any, **kwargs: Any) -> Any:
        plan = plan_of_call(*args, **kwargs)
        waves.append(plan.waves)
        return plan
    moe_function.build_route_plan = recording  # type: ignore[assignment]
    try:
        yield waves
    finally:
        moe_function.build_route_plan = plan_of_call  # type: ignore[assignment]


def full_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    gate_up = torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=gen, dtype=dtype) * 0.3
    down = torch.randn(EXPERTS, INTER, HIDDEN, generator=gen, dtype=dtype) * 0.3
    return gate_up, down


def compare_with_reference(rank: int, world: int, cases: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Per case (scenario, overlap_chunks, swiglu_limit[, dtype[, expert_capacity_factor[, gemm_dtype]]]): the
    largest difference of output and every gradient, whether experts without tokens got exact
    zero weight grads, and how many waves the call took."""
    distributed = world > 1
    report: dict[str, Any] = {}
    pairs: list[Any] = []
    for label, chunks, limit, *rest in cases:
        dtype = rest[0] if rest else torch.float64
        capacity = rest[1] if len(rest) > 1 else None
        gemm = rest[2] if len(rest) > 2 else None
        scenario, group, ep = label, None, world
        full = label.startswith("full/")  # (nearly) local_num_tokens tokens per rank
        if full:
            scenario = label.split("/", 1)[1]
        if label.startswith("pairs/"):  # EP groups {0, 1}, {2, 3}, ... instead of the world
            scenario = label.split("/", 1)[1]
            if not pairs:
                pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
            group, ep = pairs[rank // 2], 2
        gate_up_full, down_full = full_weights(dtype)
        gen = torch.Generator().manual_seed(100 + rank)
        tokens = 5 + 3 * rank if scenario != "idle_rank" or rank != 0 else 0  # uneven counts
        if full:
            tokens = MAX_TOKENS - rank
        x = torch.randn(tokens, HIDDEN, generator=gen, dtype=dtype)
        ids = routing("uniform" if scenario == "idle_rank" else scenario, tokens, rank, ep, gen)
        w = torch.rand(tokens, TOP_K, generator=gen, dtype=dtype)
        grad_out = torch.randn(tokens, HIDDEN, generator=gen, dtype=dtype)

        layer = MoeExperts(local_num_tokens=MAX_TOKENS, hidden_size=HIDDEN, intermediate_size=INTER,
                           num_experts=EXPERTS, top_k=TOP_K, ep_size=ep, ep_group=group,
                           overlap_chunks=chunks, swiglu_limit=limit,
                           expert_capacity_factor=capacity, gemm_dtype=gemm).to(dtype)
        mine = layer.local_expert_ids
        with torch.no_grad():
            layer.gate_up_weight.copy_(gate_up_full[mine.start:mine.stop])
            layer.down_weight.copy_(down_full[mine.start:mine.stop])
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        with _recording_waves() as waves:
            out = layer(x1, ids, w1, tokens_per_expert=torch.bincount(ids.flatten(), minlength=EXPERTS))
        out.backward(grad_out)

        x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
        gu2, dn2 = gate_up_full.clone().requires_grad_(), down_full.clone().requires_grad_()
        ref = dense_moe_reference(x2, ids, w2, gu2, dn2, limit)
        ref.backward(grad_out)
        out, ref = out.detach(), ref.detach()
        gu_grad, dn_grad = gu2.grad, dn2.grad
        used = torch.bincount(ids.flatten(), minlength=EXPERTS)
        if distributed:
            dist.all_reduce(gu_grad, group=group)
            dist.all_reduce(dn_grad, group=group)
            dist.all_reduce(used, group=group)
        unused_local = [e - mine.start for e in mine if int(used[e]) == 0]
        gemm_note = "" if gemm is None else f"/gemm={gemm}"
        suffix = ("" if capacity is None else f"/capacity={capacity}") + gemm_note
        report[f"{label}/chunks={chunks}/limit={limit}/{dtype}{suffix}"] = {
            "dtype": str(dtype) + gemm_note,
            "output_dtype": str(out.dtype),
            "grad_dtypes": [str(g.dtype) for g in (x1.grad, w1.grad, layer.gate_up_weight.grad)],
            "waves": waves,
            "output": _max_diff(out, ref),
            "hidden_grad": _max_diff(x1.grad, x2.grad),
            "weights_grad": _max_diff(w1.grad, w2.grad),
            "gate_up_grad": _max_diff(layer.gate_up_weight.grad, gu_grad[mine.start:mine.stop]),
            "down_grad": _max_diff(layer.down_weight.grad, dn_grad[mine.start:mine.stop]),
            "scale": {key: _max_abs(t) for key, t in (
                ("output", ref), ("hidden_grad", x2.grad), ("weights_grad", w2.grad),
                ("gate_up_grad", gu_grad[mine.start:mine.stop]),
                ("down_grad", dn_grad[mine.start:mine.stop]))},
            "unused_experts": unused_local,
            "unused_exact_zero": all(
                bool((layer.gate_up_weight.grad[e] == 0).all() and (layer.down_weight.grad[e] == 0).all())
                for e in unused_local),
        }
        layer.close()
    return report
