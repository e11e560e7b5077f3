"""MoeExperts is one custom op per direction whose saved activations are real outputs and
inputs: saved-tensor hooks see them, an OffloadSession counts and moves them with results
bitwise equal to the same layer without a session (2 ranks, 50 % and 0 % of the peak),
and torch.compile runs a model around it."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyperpar.multicore.moe import MoeExperts
from hyperpar.offload import OffloadConfig, OffloadSession
from tests.rank_harness import run_ranks
from tests.reliability.bitwise import same_bits
from tests.reliability.offload_rank_bodies import MoeNet

H, E, K, T = 16, 4, 2, 6


def _layer_and_inputs(seed: int = 0, dtype: torch.dtype = torch.float32,
                      ) -> tuple[MoeExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    layer = MoeExperts(local_num_tokens=T, hidden_size=H, intermediate_size=8, num_experts=E, top_k=K)
    layer = layer.to(dtype)
    x = torch.randn(T, H).to(dtype).requires_grad_()
    weights, ids = torch.randn(T, E).softmax(-1).topk(K, -1)
    return layer, x, ids, weights.to(dtype).requires_grad_()


def test_saved_activations_go_through_saved_tensor_hooks() -> None:
    torch.set_num_threads(1)
    layer, x, ids, w = _layer_and_inputs()
    packed: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, ids, w).square().sum().backward()
    # rows into the experts [T*K, H], their pre-activations [T*K, 2I], the route weights [T, K]
    assert {(T * K, H), (T * K, 16), (T, K)} <= set(packed), packed
    plain_grads = [x.grad.clone(), w.grad.clone(), layer.gate_up_weight.grad.clone()]
    x.grad = w.grad = None
    layer.zero_grad(set_to_none=True)
    with torch.autograd.graph.save_on_cpu():
        layer(x, ids, w).square().sum().backward()
    assert all(same_bits(a, b) for a, b in zip(plain_grads, [x.grad, w.grad, layer.gate_up_weight.grad],
                                               strict=True))
    layer.close()


def test_a_session_sees_one_op_each_way_with_its_saved_outputs() -> None:
    torch.set_num_threads(1)
    layer, x, ids, w = _layer_and_inputs()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1024))
    with session:
        layer(x, ids, w).square().sum().backward()
    assert session.trace is not None
    names = [op.name for op in session.trace.ops]
    assert names.count("hyperpar.moe_experts.default") == 1, names
    assert names.count("hyperpar.moe_experts_backward.default") == 1, names
    assert not any(n.startswith("skip_offload") or "mm" in n for n in names), names  # inside: untraced
    forward = session.trace.ops[names.index("hyperpar.moe_experts.default")]
    backward = session.trace.ops[names.index("hyperpar.moe_experts_backward.default")]
    written = {a.storage_id for a in forward.accesses if a.kind.name == "WRITE"}
    read_back = {a.storage_id for a in backward.accesses if a.kind.name == "READ"}
    # the output and the two saved tensors (rows, pre-activations) are activations the backward
    # op reads again (the per-route outputs are not kept: the route weights' gradient is taken
    # on the expert side)
    assert len(written) == 3 and len(written & read_back) == 2, (forward, backward)
    sizes = sorted(session.trace.storage_sizes[s] for s in written & read_back)
    assert sizes == sorted([T * K * H * 4, T * K * 16 * 4])
    layer.close()


def _session_matches_plain(rank: int, world: int, fraction: float, same_batch: bool,
                           steps: int) -> dict[str, Any]:
    ep = world if dist.is_initialized() else 1
    torch.manual_seed(0)
    plain = MoeNet(ep)
    torch.manual_seed(0)
    off = MoeNet(ep)
    gen = torch.Generator().manual_seed(rank)
    first = torch.randn(T, H, generator=gen)
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1024))
    with probe:
        off(first).backward()
    assert probe.last_report is not None
    peak = probe.last_report.peak_resident_bytes
    off.zero_grad(set_to_none=True)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=fraction * peak / (1 << 20)))
    differs: list[str] = []
    phases: list[str] = []
    moved = 0
    for step in range(steps):
        x = first if same_batch else torch.randn(T, H, generator=gen)
        loss_a = plain(x)
        loss_a.backward()
        with session:
            loss_b = off(x)
            loss_b.backward()
        assert session.last_report is not None
        phases.append(session.last_report.phase)
        moved += session.last_report.bytes_d2h
        if not same_bits(loss_a.detach(), loss_b.detach()):
            differs.append(f"step {step}: loss")
        for (name, pa), pb in zip(plain.named_parameters(), off.parameters(), strict=True):
            if not same_bits(pa.grad, pb.grad):
                differs.append(f"step {step}: grad of {name}")
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
    plain.experts.close()
    off.experts.close()
    return {"differs": differs, "phases": phases, "moved": moved, "peak": peak}


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_two_ranks_bitwise_equal_in_a_session(fraction: float) -> None:
    """Same routing every step: warmup, then replay of the plan."""
    results = run_ranks(_session_matches_plain, 2, args=(fraction, True, 3), timeout=90)
    for rank, out in results.items():
        assert out["differs"] == [], (rank, out["differs"])
        assert out["phases"] == ["warmup", "replay", "replay"], (rank, out["phases"])
        assert out["moved"] > 0, rank


@functools.cache
def _changing_routing() -> dict[int, dict[str, Any]]:
    """One 2-rank run, read by the two tests below (it costs a process group each)."""
    return run_ranks(_session_matches_plain, 2, args=(0.5, False, 3), timeout=90)


def test_two_ranks_bitwise_equal_with_changing_routing() -> None:
    for rank, out in _changing_routing().items():
        assert out["differs"] == [], (rank, out["differs"])
        assert out["moved"] > 0, rank


def test_changing_routing_replays_the_plan() -> None:
    results = _changing_routing()
    assert all(out["phases"][1:] == ["replay", "replay"] for out in results.values()), results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_under_torch_compile(dtype: torch.dtype) -> None:
    torch.set_num_threads(1)
    layer, x, ids, w = _layer_and_inputs(dtype=dtype)

    def step(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(layer(torch.relu(x), ids, w)) * 2).sum()

    compiled = torch.compile(step, backend="aot_eager")
    for routing in (ids, ids.flip(0)):  # a second call with other routing reuses the compiled graphs
        step(x, routing, w).backward()
        want = [x.grad.clone(), w.grad.clone(), layer.down_weight.grad.clone()]
        x.grad = w.grad = None
        layer.zero_grad(set_to_none=True)
        compiled(x, routing, w).backward()
        got = [x.grad, w.grad, layer.down_weight.grad]
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b) if dtype == torch.bfloat16 else torch.allclose(a, b, rtol=0, atol=1e-6)
        x.grad = w.grad = None
        layer.zero_grad(set_to_none=True)
    assert layer.workspace_bytes == 0 and layer._resource_group.resources.pending_backwards == 0
    layer.close()
