"""Bad input, mismatched configuration or grad mode raise on every rank;
nothing hangs; ranks that need different gradients still agree on the backward collectives."""

from __future__ import annotations

import torch

from hyperpar.multicore.moe import MoeExperts
from tests.rank_harness import run_ranks

H, INTER, E, K, MAX_T = 16, 8, 4, 2, 8


def _layer(world: int, **overrides: object) -> MoeExperts:
    kwargs: dict = dict(local_num_tokens=MAX_T, hidden_size=H, intermediate_size=INTER, num_experts=E,
                        top_k=K, ep_size=world)
    kwargs.update(overrides)
    return MoeExperts(**kwargs)


def _error_text(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _failures_body(rank: int, world: int) -> dict[str, str]:
    torch.manual_seed(rank)
    out: dict[str, str] = {}
    x = torch.randn(MAX_T, H)
    w = torch.rand(MAX_T, K)
    spread = torch.tensor([[0, 2], [1, 3]] * (MAX_T // 2))
    layer = _layer(world, expert_capacity_factor=1.0)  # an overflow runs in waves: test_multi_wave.py
    tokens = MAX_T + 1 if rank == 1 else MAX_T
    out["too_many_tokens"] = _error_text(
        lambda: layer(torch.randn(tokens, H), spread[:1].repeat(tokens, 1), torch.rand(tokens, K)))
    wrong_counts = torch.bincount(spread.flatten(), minlength=E) + (1 if rank == 0 else 0)
    out["tokens_per_expert"] = _error_text(lambda: layer(x, spread, w, tokens_per_expert=wrong_counts))
    bad_ids = spread.clone()
    if rank == 1:
        bad_ids[0, 0] = E
    out["id_range"] = _error_text(lambda: layer(x, bad_ids, w))
    fine = layer(x, spread, w)  # the layer still works after all of that
    out["after_errors"] = f"ok {tuple(fine.shape)}"
    del fine  # its graph would hold the workspace and close() would (rightly) refuse
    layer.close()
    mismatched = _layer(world, swiglu_limit=None if rank == 0 else 3.0)
    out["config_mismatch"] = _error_text(lambda: mismatched(x, spread, w))
    return out


def _grad_modes(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    torch.manual_seed(0)
    layer = _layer(world)
    x = torch.randn(MAX_T, H)
    ids = torch.tensor([[0, 2], [1, 3]] * (MAX_T // 2))
    w = torch.rand(MAX_T, K)

    def call() -> None:
        if rank == 0:
            with torch.no_grad():
                layer(x, ids, w)
        else:
            layer(x, ids, w)
    out["grad_mode_mismatch"] = _error_text(call)
    # frozen input everywhere: expert gradients only, no return trip in backward
    layer(x, ids, w).square().sum().backward()
    frozen = [p.grad.clone() for p in (layer.gate_up_weight, layer.down_weight)]
    layer.zero_grad()
    # only rank 0's input is trainable: both ranks still make the return trip
    x_in = x.clone().requires_grad_(rank == 0)
    layer(x_in, ids, w).square().sum().backward()
    out["weight_grads_equal"] = all(torch.equal(a, p.grad) for a, p in
                                    zip(frozen, (layer.gate_up_weight, layer.down_weight), strict=True))
    out["hidden_grad"] = None if x_in.grad is None else float(x_in.grad.abs().sum())
    layer.close()
    return out


def _body(rank: int, world: int) -> dict[str, object]:
    return {**_failures_body(rank, world), **_grad_modes(rank, world)}


def test_errors_are_raised_on_every_rank() -> None:
    results = run_ranks(_body, 2, timeout=60)
    for rank, out in results.items():
        assert out["too_many_tokens"].startswith("ValueError") and "EP rank 1" in out["too_many_tokens"]
        assert "exceed local_num_tokens=8" in out["too_many_tokens"], out["too_many_tokens"]
        assert "EP rank 0: tokens_per_expert" in out["tokens_per_expert"], out["tokens_per_expert"]
        assert "EP rank 1: topk_ids must lie in [0, 4)" in out["id_range"], out["id_range"]
        assert out["after_errors"] == f"ok {(MAX_T, H)}", f"rank {rank}"
        assert out["config_mismatch"] != "no error"
        assert "3.0" in out["config_mismatch"], out["config_mismatch"]
        assert "autograd records this call on EP ranks [1] but not on [0]" in out["grad_mode_mismatch"]
        assert out["weight_grads_equal"], f"rank {rank}"
    assert results[0]["hidden_grad"] > 0 and results[1]["hidden_grad"] is None
    assert results[0]["config_mismatch"] == results[1]["config_mismatch"]
