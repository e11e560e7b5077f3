"""A configuration that differs across EP ranks raises the library's collective error on every
rank, as docs/multicore.md ("Lazy binding") promises: callers catching ValueError and callers
catching CollectiveError (a RuntimeError) both see it, with the differing fields and ranks named."""

from __future__ import annotations

import torch

from hyperpar.multicore import CollectiveError
from hyperpar.multicore.moe import MoeExperts
from tests.rank_harness import run_ranks

H, INTER, E, K, MAX_T = 16, 8, 4, 2, 8


def _mismatched(rank: int, world: int) -> MoeExperts:
    return MoeExperts(local_num_tokens=MAX_T, hidden_size=H, intermediate_size=INTER, num_experts=E,
                      top_k=K, ep_size=world, swiglu_limit=None if rank == 0 else 3.0)


def _call(layer: MoeExperts) -> None:
    ids = torch.tensor([[0, 2], [1, 3]] * (MAX_T // 2))
    layer(torch.randn(MAX_T, H), ids, torch.rand(MAX_T, K))


def _body(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, kind in (("value", ValueError), ("collective", CollectiveError), ("runtime", RuntimeError)):
        try:
            _call(_mismatched(rank, world))
        except kind as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
    return out


def test_config_mismatch_raises_collective_value_error_on_every_rank() -> None:
    results = run_ranks(_body, 2, timeout=60)
    for rank, out in results.items():
        for name, text in out.items():
            assert text.startswith("CollectiveValueError"), f"rank {rank}, except {name}: {text}"
            assert "swiglu_limit" in text and "EP rank 0" in text and "EP rank 1" in text, text
            assert "3.0" in text, text
    assert results[0] == results[1]
