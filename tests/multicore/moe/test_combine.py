"""The token-side route sums match bmm's arithmetic: float32 accumulation, one rounding."""

from __future__ import annotations

import pytest
import torch

from hyperpar.multicore.moe.combine import weighted_sum


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_sum_rounds_once(top_k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(top_k)
    per_route = torch.randn(64, top_k, 96, generator=gen).to(dtype)
    weights = torch.rand(64, top_k, generator=gen).to(dtype)
    terms = per_route.double() * weights.double().unsqueeze(-1)
    exact, magnitude = terms.sum(1), terms.abs().sum(1)
    got = weighted_sum(per_route, weights)
    assert got.dtype == dtype and got.shape == (64, 96)
    # one rounding to dtype (unit roundoff u) plus float32 accumulation; rounding every partial
    # sum to bfloat16 would exceed this wherever terms cancel
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    bound = exact.abs() * u + magnitude * top_k * 2.0 ** -23
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_weighted_sum_float32_is_bmm() -> None:
    per_route = torch.randn(32, 3, 16)
    weights = torch.rand(32, 3)
    expected = torch.bmm(weights.unsqueeze(1), per_route).squeeze(1)
    assert torch.equal(weighted_sum(per_route, weights), expected)

