"""MoeExperts called inside ``torch.autocast``: the layer computes exactly as outside it, in its
inputs' and weights' dtypes (and ``gemm_dtype``'s), output in the input's dtype. Before, the
custom op's body ran its GEMMs under the caller's autocast and returned bf16 for float32
inputs. On 1 and 2 gloo ranks, bitwise against the same call without autocast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyperpar.multicore import MoeExperts
from tests.rank_harness import run_ranks


def _with_and_without_autocast(rank: int, world: int, gemm_dtype: torch.dtype | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same weights on every rank
    layer = MoeExperts(local_num_tokens=48, hidden_size=32, intermediate_size=16, num_experts=4, top_k=2,
                       ep_size=world, gemm_dtype=gemm_dtype)
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(48, 32, generator=g).requires_grad_()
    ids = torch.randint(0, 4, (48, 2), generator=g)
    weights = torch.rand(48, 2, generator=g).requires_grad_()
    results = []
    for autocast in (False, True):
        for t in (x, weights, *layer.parameters()):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x, ids, weights)
            out.float().square().sum().backward()  # backward inside the region too
        results.append((out.detach(), x.grad, weights.grad, *(p.grad for p in layer.parameters())))
    if world > 1:
        dist.barrier()
    layer.close()
    plain, cast = results
    return {"output_dtype": str(cast[0].dtype),
            "equal": [torch.equal(a, b) for a, b in zip(plain, cast, strict=True)]}


def _check(report: dict[str, Any]) -> None:
    assert report["output_dtype"] == "torch.float32"
    assert all(report["equal"]), report["equal"]  # output, then every gradient


@pytest.mark.parametrize("gemm_dtype", [None, torch.bfloat16])
def test_one_rank_autocast_changes_nothing(gemm_dtype: torch.dtype | None) -> None:
    _check(_with_and_without_autocast(0, 1, gemm_dtype))


def test_two_ranks_autocast_changes_nothing() -> None:
    for report in run_ranks(_with_and_without_autocast, 2, args=(None,), timeout=90).values():
        _check(report)
