"""The workspace is allocated once, leased serially, and not closed under a pending backward."""

from __future__ import annotations

import gc

import pytest
import torch

from hyperpar.multicore.moe import MoeExperts, MoeWorkspace

H, INTER, E, K, T = 16, 8, 4, 2, 6


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(T, H), torch.randint(0, E, (T, K)), torch.rand(T, K)


def _layer(**kw: object) -> MoeExperts:
    return MoeExperts(local_num_tokens=T, hidden_size=H, intermediate_size=INTER, num_experts=E, top_k=K,
                      **kw)


def test_allocated_once_and_reused() -> None:
    layer = _layer()
    x, ids, w = _inputs()
    assert layer.workspace_bytes == 0
    layer(x, ids, w).sum().backward()
    first = layer._resource_group.resources
    assert isinstance(first, MoeWorkspace) and layer.workspace_bytes == 0  # one rank needs no buffers
    layer(x, ids, w).sum().backward()
    assert layer._resource_group.resources is first
    layer.close()


def test_concurrent_call_is_an_error() -> None:
    layer = _layer()
    x, ids, w = _inputs()
    layer(x, ids, w).sum().backward()
    workspace = layer._resource_group.resources
    with workspace.lease("forward"), pytest.raises(RuntimeError, match="one at a time"):
        layer(x, ids, w)
    layer(x, ids, w).sum().backward()  # the lease was given back
    layer.close()


def test_close_refuses_while_a_backward_is_pending() -> None:
    layer = _layer()
    x, ids, w = _inputs()
    out = layer(x, ids, w)
    with pytest.raises(RuntimeError, match="pending backward"):
        layer.close()
    out.sum().backward()
    layer.close()
    assert layer.execution_resources_closed
    with pytest.raises(RuntimeError, match="after close"):
        layer(x, ids, w)


def test_a_freed_graph_releases_the_workspace() -> None:
    layer = _layer()
    x, ids, w = _inputs()
    out = layer(x, ids, w)
    workspace = layer._resource_group.resources
    assert workspace.pending_backwards == 1
    del out
    gc.collect()
    assert workspace.pending_backwards == 0
    with torch.no_grad():
        layer(x, ids, w)
    assert workspace.pending_backwards == 0  # nothing saved without grad
    layer.close()


def test_external_weights_any_leading_shape_and_bfloat16() -> None:
    layer = _layer(create_parameters=False)
    x, ids, w = _inputs()
    gate_up = torch.randn(E, H, 2 * INTER, dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(E, INTER, H, dtype=torch.bfloat16, requires_grad=True)
    x3 = x.to(torch.bfloat16).view(2, T // 2, H).requires_grad_()
    out = layer(x3, ids, w, expert_weights=(gate_up, down))
    assert out.shape == (2, T // 2, H) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert gate_up.grad is not None and down.grad is not None and x3.grad is not None
    assert gate_up.grad.dtype == torch.bfloat16 and w.grad is None
    with pytest.raises(ValueError, match="expert_weights"):
        layer(x3, ids, w)
    with pytest.raises(ValueError, match=r"bound to device=cpu, dtype=torch\.bfloat16"):
        layer(x, ids, w, expert_weights=(gate_up.float(), down.float()))
    layer.close()


def test_shape_problems_name_the_argument() -> None:
    layer = _layer()
    x, ids, w = _inputs()
    with pytest.raises(ValueError, match="hidden_states must end in hidden_size=16"):
        layer(torch.randn(T, H + 1), ids, w)
    with pytest.raises(ValueError, match=r"topk_weights must have shape \[6, 2\]"):
        layer(x, ids, w[:, :1])
    with pytest.raises(ValueError, match="topk_ids must be an integer tensor"):
        layer(x, ids.float(), w)
    layer.close()
