"""Every input check of MoeExperts, failing on ONE rank only, raises the same error on both ranks,
at once, before anything binds or moves; the layer stays usable (issue 14, items 1 and 4).

All checks run in one spawn of 2 gloo ranks (the fixture); each has its own test. The layer runs
over an EP group with a 10 s timeout, so a check that left a rank alone in a collective shows as
a timeout message on that rank (and a slow time), not as a hang of the whole run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyperpar.multicore import MoeExperts
from tests.rank_harness import run_ranks

H, INTER, E, K, T = 16, 8, 4, 2, 6
FAST_S = 3.0  # far below the group's 10 s timeout

Args = tuple[Any, Any, Any, dict[str, Any]]  # hidden_states, topk_ids, topk_weights, keywords
Mistake = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Args]


def _counts(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids.flatten(), minlength=E)


def _external(hidden: int, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    weights = (torch.randn(E // 2, hidden, 2 * INTER, generator=gen, dtype=dtype),
               torch.randn(E // 2, INTER, H, generator=gen, dtype=dtype))
    return tuple(w.to(device) for w in weights)


def _tpe(value: Any) -> Mistake:
    """The good arguments with ``tokens_per_expert=value(ids)``."""
    return lambda x, i, w: (x, i, w, {"tokens_per_expert": value(i)})


def _external_weights(value: Any) -> Mistake:
    return lambda x, i, w: (x, i, w, {"expert_weights": value})


# name -> (which layer, the bad rank's arguments from the good ones, text every rank must see)
CHECKS: dict[str, tuple[str, Mistake, str]] = {
    "hidden not a tensor": (
        "bound", lambda x, i, w: (x.tolist(), i, w, {}), "hidden_states must be a torch.Tensor, got list"),
    "hidden not a tensor, first call": (
        "fresh", lambda x, i, w: (x.tolist(), i, w, {}), "hidden_states must be a torch.Tensor, got list"),
    "hidden width": ("bound", lambda x, i, w: (x[:, :-1], i, w, {}), "must end in hidden_size=16"),
    "hidden dtype vs binding": (
        "bound", lambda x, i, w: (x.double(), i, w, {}),
        "bound to device=cpu, dtype=torch.float32; got device=cpu, dtype=torch.float64"),
    "hidden dtype, first call": (
        "fresh", lambda x, i, w: (x.bfloat16(), i, w.bfloat16(), {}),
        "gate_up_weight is torch.float32 on cpu but hidden_states is torch.bfloat16"),
    "hidden on another device": (
        "bound", lambda x, i, w: (x.to("meta"), i.to("meta"), w.to("meta"), {}),
        "got device=meta, dtype=torch.float32"),
    "too many tokens": (
        "bound", lambda x, i, w: (torch.cat([x, x]), torch.cat([i, i]), torch.cat([w, w]), {}),
        "12 tokens exceed local_num_tokens=6"),
    "ids not a tensor": ("bound", lambda x, i, w: (x, i.tolist(), w, {}), "topk_ids must be a tensor on cpu"),
    "ids float": ("bound", lambda x, i, w: (x, i.float(), w, {}), "topk_ids must be an integer tensor"),
    "ids shape": ("bound", lambda x, i, w: (x, i[:, :1], w, {}), "topk_ids must have shape [6, 2]"),
    "ids too large": ("bound", lambda x, i, w: (x, i + E, w, {}), "topk_ids must lie in [0, 4)"),
    "ids negative": (
        "bound", lambda x, i, w: (x, i - E, w, {}), "topk_ids must lie in [0, 4), got values in [-"),
    "ids on another device": ("bound", lambda x, i, w: (x, i.to("meta"), w, {}), "got one on meta"),
    "weights not floating": ("bound", lambda x, i, w: (x, i, i, {}), "topk_weights must be a floating-point"),
    "weights shape": ("bound", lambda x, i, w: (x, i, w[:1], {}), "topk_weights must have shape [6, 2]"),
    "weights on another device": (
        "bound", lambda x, i, w: (x, i, w.to("meta"), {}),
        "topk_weights must be on cpu like hidden_states, got meta"),
    "tokens_per_expert not a tensor": (
        "bound", _tpe(lambda i: [1] * E), "tokens_per_expert must be None or a tensor, got list"),
    "tokens_per_expert wrong counts": (
        "bound", _tpe(lambda i: _counts(i) + 1), "does not match the counts of topk_ids"),
    "tokens_per_expert float, right values": (
        "bound", _tpe(lambda i: _counts(i).float()),
        "tokens_per_expert must be an integer tensor (counts), got dtype=torch.float32"),
    "tokens_per_expert float, wrong values": (
        "bound", _tpe(lambda i: _counts(i).float() + 0.5),
        "tokens_per_expert must be an integer tensor (counts), got dtype=torch.float32"),
    "tokens_per_expert length": (
        "bound", _tpe(lambda i: _counts(i)[:2]), "does not match the counts of topk_ids"),
    "tokens_per_expert unreadable": (
        "bound", _tpe(lambda i: _counts(i).to("meta")), "topk_ids or tokens_per_expert cannot be read"),
    "expert_weights given": (
        "bound", lambda x, i, w: (x, i, w, {"expert_weights": (x, x)}),
        "expert_weights must be None when create_parameters=True"),
    "external weights missing": (
        "external", _external_weights(None),
        "create_parameters=False needs expert_weights=(gate_up_weight, down_weight)"),
    "external weights shape": (
        "external", _external_weights(_external(H + 1)),
        "gate_up_weight must have shape [2, 16, 16], got [2, 17, 16]"),
    "external weights dtype": (
        "external", _external_weights(_external(H, torch.float64)),
        "gate_up_weight is torch.float64 on cpu but hidden_states is torch.float32"),
    "external weights device": (
        "external", _external_weights(_external(H, device="meta")),
        "down_weight is torch.float32 on meta but hidden_states"),
}


def _body(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=10))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)

    def layer(**kwargs: Any) -> MoeExperts:
        return MoeExperts(local_num_tokens=T, hidden_size=H, intermediate_size=INTER, num_experts=E, top_k=K,
                          ep_size=world, ep_group=group, **kwargs)

    layers = {"bound": layer(), "external": layer(create_parameters=False)}
    good_kwargs = {"bound": {}, "external": {"expert_weights": _external(H)}}
    before = {name: m(x, ids, w, **good_kwargs[name]).detach() for name, m in layers.items()}
    out: dict[str, Any] = {}
    for index, (name, (which, mistake, _)) in enumerate(CHECKS.items()):
        bad = index % 2  # the failing rank alternates
        target = layer() if which == "fresh" else layers[which]
        kwargs = good_kwargs.get(which, {})
        args = mistake(x, ids, w) if rank == bad else (x, ids, w, kwargs)
        start = time.monotonic()
        try:
            target(*args[:3], **args[3])
            outcome = "no error"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        out[name] = {"bad": bad, "outcome": outcome, "seconds": time.monotonic() - start}
        if which == "fresh":  # a rejected first call binds nothing; the right call then binds
            out[name]["bound_after_rejection"] = target.binding_id
            target(x, ids, w)
            out[name]["bound_after_good_call"] = (target.binding_id is not None,
                                                  target._resource_group.dtype)
            target.close()
    # after all of that, the layers give the same answer as before, bit for bit
    out["usable"] = all(torch.equal(m(x, ids, w, **good_kwargs[name]).detach(), before[name])
                        for name, m in layers.items())
    for m in layers.values():
        m.close()
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, Any]]:
    return run_ranks(_body, 2, timeout=120)


@pytest.mark.parametrize("name", list(CHECKS))
def test_a_mistake_on_one_rank_raises_the_same_error_on_both_at_once(
        name: str, results: dict[int, dict[str, Any]]) -> None:
    text = CHECKS[name][2]
    reports = [results[rank][name] for rank in (0, 1)]
    assert reports[0]["outcome"] == reports[1]["outcome"], reports
    outcome = reports[0]["outcome"]
    assert outcome.startswith("ValueError: MoeExperts input rejected by EP rank(s) "
                              f"{reports[0]['bad']} before any dispatch"), outcome
    assert f"EP rank {reports[0]['bad']}: " in outcome and text in outcome, outcome
    assert all(r["seconds"] < FAST_S for r in reports), reports
    if CHECKS[name][0] == "fresh":
        for report in reports:
            assert report["bound_after_rejection"] is None
            assert report["bound_after_good_call"] == (True, torch.float32)


def test_the_layers_still_give_the_same_answer(results: dict[int, dict[str, Any]]) -> None:
    assert results[0]["usable"] and results[1]["usable"]
