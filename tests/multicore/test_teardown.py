"""On 2 real gloo ranks (issue 14): a failing rank tears down at once while its peer is inside a
collective; ep_size=1 layers never communicate; a closed layer keeps no process group alive."""

from __future__ import annotations

import copy
import gc
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hyperpar.multicore import MANAGER, MoeExperts, closing
from tests.multicore.moe.scenarios import EXPERTS, HIDDEN, INTER, MAX_TOKENS, TOP_K, routing
from tests.rank_harness import run_ranks

FAST_S = 1.0


def _layer(ep_size: int, **kwargs: Any) -> MoeExperts:
    return MoeExperts(local_num_tokens=MAX_TOKENS, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_experts=EXPERTS, top_k=TOP_K, ep_size=ep_size, **kwargs)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    ids = routing("uniform", MAX_TOKENS, rank, 2, gen)
    return torch.randn(MAX_TOKENS, HIDDEN, generator=gen), ids, torch.rand(MAX_TOKENS, TOP_K, generator=gen)


def _seconds(step: Callable[[], Any]) -> float:
    start = time.monotonic()
    step()
    return time.monotonic() - start


def _failing_rank_body(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 raises in user code inside closing() and destroys the process group in `finally`,
    while rank 1 is in an all_reduce; both hold bound layers."""
    x, ids, w = _inputs(rank)
    left_open = _layer(world)
    left_open(x, ids, w).sum().backward()
    stack = [_layer(world) for _ in range(2)]
    MoeExperts.share_execution_resources(stack)
    stack[1](stack[0](x, ids, w), ids, w).sum().backward()
    dist.barrier()
    start = time.monotonic()
    if rank == 1:
        try:
            dist.all_reduce(torch.ones(1))
            outcome = "no error"
        except Exception as exc:
            outcome = type(exc).__name__
        return {"outcome": outcome, "seconds": time.monotonic() - start}
    try:
        try:
            with closing(stack):
                raise RuntimeError("user code failed")
        finally:
            closing_s = time.monotonic() - start
            dist.destroy_process_group()
    except RuntimeError as exc:
        outcome = str(exc)
    return {"outcome": outcome, "closing_s": closing_s, "seconds": time.monotonic() - start,
            "stack_closed": [m.execution_resources_closed for m in stack],
            "left_open": not left_open.execution_resources_closed}  # released at exit, locally


def test_a_failing_rank_tears_down_at_once_while_its_peer_is_in_a_collective() -> None:
    results = run_ranks(_failing_rank_body, 2, timeout=90)
    failing, peer = results[0], results[1]
    assert failing["outcome"] == "user code failed"
    assert failing["closing_s"] < FAST_S and failing["seconds"] < FAST_S, failing
    assert failing["stack_closed"] == [True, True] and failing["left_open"]
    assert peer["outcome"] != "no error"  # its all_reduce fails once rank 0 is gone, instead of hanging


def _rank0_alone_body(rank: int, world: int, marker_dir: str) -> dict[str, Any]:
    """ep_size=1 layers in a 2-rank world: rank 0 alone runs a first forward, evaluates a deepcopy
    and closes, while rank 1 waits on a file (in no collective). Any collective would block."""
    done = Path(marker_dir) / "rank0-done"
    x, ids, w = _inputs(rank)
    trained = _layer(1)
    trained(x, ids, w).sum().backward()  # on both ranks, independently
    if rank == 1:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"root": trained._root_group()}
    fresh = _layer(1)
    out: dict[str, Any] = {"root": trained._root_group()}

    def evaluate_copy() -> None:
        clone = copy.deepcopy(trained)
        with torch.no_grad():
            clone(x, ids, w)
        clone.close()

    out["first forward"] = _seconds(lambda: fresh(x, ids, w).sum().backward())
    out["deepcopy"] = _seconds(evaluate_copy)
    out["close"] = _seconds(fresh.close)
    out["close trained"] = _seconds(trained.close)
    out["scopes"] = [g.scope.key for g in MANAGER.bound_groups() if g.scope is not None]
    done.touch()
    return out


def _references_body(rank: int, world: int) -> dict[str, Any]:
    """A closed layer holds no process group: once torch destroys it, nothing keeps it alive."""
    x, ids, w = _inputs(rank)
    sub = dist.new_group(list(range(world)))
    on_sub, on_world = _layer(world, ep_group=sub), _layer(world)
    out: dict[str, Any] = {"default group held": on_world.ep_group}
    for layer in (on_sub, on_world):
        layer(x, ids, w).sum().backward()
        layer.close()
    out["dropped"] = (on_sub.ep_group, on_sub._routing, on_sub._math)
    sub_ref, world_ref = weakref.ref(sub), weakref.ref(dist.group.WORLD)
    dist.destroy_process_group(sub)
    del sub
    dist.destroy_process_group()
    gc.collect()
    out["freed"] = (sub_ref() is None, world_ref() is None)
    return out


def _no_stray_communication_body(rank: int, world: int, marker_dir: str) -> dict[str, Any]:
    return {**_rank0_alone_body(rank, world, marker_dir), **_references_body(rank, world)}


def test_ep1_never_communicates_and_closed_layers_hold_no_process_group() -> None:
    with tempfile.TemporaryDirectory() as marker_dir:
        results = run_ranks(_no_stray_communication_body, 2, args=(marker_dir,), timeout=90)
    alone = results[0]
    for step in ("first forward", "deepcopy", "close", "close trained"):
        assert alone[step] < FAST_S, (step, alone)
    assert alone["scopes"] == [] and alone["root"] is None and results[1]["root"] is None
    for out in results.values():
        assert out["default group held"] is None
        assert out["dropped"] == (None, None, None)
        assert out["freed"] == (True, True)
