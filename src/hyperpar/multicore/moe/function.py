"""Forward and backward of the routed experts as one ``autograd.Function``.

Dispatch, expert compute and combine run per chunk of tokens with asynchronous
all-to-alls, so while one chunk's rows are on the wire another chunk is computed;
backward walks the same route in reverse. Everything saved for backward is an owned
tensor, never a workspace view, so a shared workspace can serve the next layer
before this layer's backward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .grouped_gemm import grouped_mm, grouped_weight_grad
from .routing import ChunkRoute, RoutePlan
from .swiglu import swiglu, swiglu_backward
from .workspace import MoeWorkspace


@dataclass(frozen=True)
class ExpertMath:
    swiglu_limit: float | None
    ep_size: int
    group: dist.ProcessGroup | None


def _exchange(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
              math: ExpertMath) -> Any:
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=math.group, async_op=True)


def _experts_forward(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, route: ChunkRoute,
                     math: ExpertMath) -> tuple[torch.Tensor, torch.Tensor]:
    pre = grouped_mm(rows, gate_up, route.expert_counts, route.expert_offsets)
    act = swiglu(pre, math.swiglu_limit)
    return pre, grouped_mm(act, down, route.expert_counts, route.expert_offsets)


WeightGrads = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _experts_backward(rows: torch.Tensor, pre: torch.Tensor, grad: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, route: ChunkRoute, math: ExpertMath, want_weights: bool,
                      want_rows: bool,
                      ) -> tuple[torch.Tensor | None, WeightGrads | None]:
    """The rows' gradient now, and (when wanted) the weight gradients as a deferred step:
    the caller runs it while the rows' gradient is on the wire back."""
    counts, offsets = route.expert_counts, route.expert_offsets
    act_grad = grouped_mm(grad, down.transpose(1, 2), counts, offsets)
    pre_grad, act = swiglu_backward(pre, act_grad, math.swiglu_limit, want_activation=want_weights)
    del act_grad
    rows_grad = None
    if want_rows:
        rows_grad = grouped_mm(pre_grad, gate_up.transpose(1, 2), counts, offsets)
    if not want_weights:
        return rows_grad, None
    assert act is not None
    activation = act

    def weight_grads() -> tuple[torch.Tensor, torch.Tensor]:
        return (grouped_weight_grad(rows, pre_grad, counts, offsets),
                grouped_weight_grad(activation, grad, counts, offsets))
    return rows_grad, weight_grads


def _accumulate(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    if part is None:
        return total
    return part if total is None else total.add_(part)


def route_rows(
    source: torch.Tensor, source_is_tokens: bool, plan: RoutePlan, workspace: MoeWorkspace,
    math: ExpertMath, compute: Any, return_results: bool = True, row_scale: torch.Tensor | None = None,
    sum_over_k: bool = False, after_dispatch: Callable[[], None] | None = None,
    after_combine: Callable[[int], None] | None = None,
) -> torch.Tensor | None:
    """Send rows of ``source`` to their experts, run ``compute(chunk_index, route,
    expert_major_rows) -> expert_major_result`` there, and bring the results back
    un-permuted: returns a new [T*K, H] tensor in (token, k) order (or nothing, without
    the return trip, when ``return_results`` is False). ``source`` holds one row per
    token ([T, H]) or one per (token, k) pair ([T*K, H]).

    ``row_scale`` ([T*K], (token, k) order) multiplies every sent row by its route's
    weight as it is gathered, so no weighted [T*K, H] copy of the source is made first.
    ``sum_over_k`` returns the results summed over each token's routes ([T, H]) instead,
    accumulated straight from the returned rows without un-permuting them first.
    ``after_dispatch()`` runs once every chunk's rows are on the wire, ``after_combine(c)``
    once chunk ``c``'s results are (or, without the return trip, once it is computed):
    work that needs neither is hidden behind the communication."""
    total_rows = plan.num_tokens * plan.top_k
    hidden = source.shape[1]
    result: torch.Tensor | None = None
    if return_results:
        result = (source.new_zeros(plan.num_tokens, hidden) if sum_over_k
                  else source.new_empty(total_rows, hidden))

    def pick(route: ChunkRoute) -> torch.Tensor:
        return route.source_token if source_is_tokens else route.order

    def gather(route: ChunkRoute, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = torch.index_select(source, 0, pick(route), out=out) if out is not None \
            else source.index_select(0, pick(route))
        if row_scale is not None:
            rows.mul_(row_scale.index_select(0, route.order).unsqueeze(1))
        return rows

    def give_back(route: ChunkRoute, rows: torch.Tensor) -> None:
        assert result is not None
        if sum_over_k:
            result.index_add_(0, route.source_token, rows)
        else:
            result.index_copy_(0, route.order, rows)

    if math.ep_size == 1:
        if after_dispatch is not None:
            after_dispatch()
        for c, route in enumerate(plan.chunks):
            out = compute(c, route, gather(route))
            if result is not None:
                give_back(route, out)
            if after_combine is not None:
                after_combine(c)
        return result

    # Each chunk owns a disjoint slice of both buffers. Its received rows are copied out
    # (owned) before its results are written back into the same slice, and its combine
    # lands in its send slice after its dispatch completed: two buffers serve four roles.
    send_all = workspace.buffer("send", total_rows, hidden)
    recv_all = workspace.buffer("recv", plan.recv_rows, hidden)

    def views(route: ChunkRoute) -> tuple[torch.Tensor, torch.Tensor]:
        return (send_all[route.send_begin:route.send_begin + route.send_rows],
                recv_all[route.recv_begin:route.recv_begin + route.recv_rows])

    dispatches = []
    for route in plan.chunks:
        send, recv = views(route)
        gather(route, send)
        dispatches.append(_exchange(recv, send, route.recv_splits, route.send_splits, math))
    if after_dispatch is not None:
        after_dispatch()
    combines = []
    for c, (route, work) in enumerate(zip(plan.chunks, dispatches, strict=True)):
        send, recv = views(route)
        work.wait()
        assert route.recv_to_expert is not None
        out = compute(c, route, recv.index_select(0, route.recv_to_expert))
        if result is not None:
            recv.index_copy_(0, route.recv_to_expert, out)
            combines.append(_exchange(send, recv, route.send_splits, route.recv_splits, math))
        if after_combine is not None:
            after_combine(c)
    if result is not None:
        for route, work in zip(plan.chunks, combines, strict=True):
            work.wait()
            give_back(route, views(route)[0])
    return result


class MoeExpertsFunction(torch.autograd.Function):
    """(hidden [T, H], topk_weights [T, K], gate_up [E_l, H, 2I], down [E_l, I, H]) -> [T, H].

    The caller holds the workspace lease during forward; backward takes it itself."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
        down: torch.Tensor, plan: RoutePlan, workspace: MoeWorkspace, math: ExpertMath,
    ) -> torch.Tensor:
        tokens, top_k = plan.num_tokens, plan.top_k
        saved_rows: list[torch.Tensor] = []
        saved_pre: list[torch.Tensor] = []

        def compute(c: int, route: ChunkRoute, rows: torch.Tensor) -> torch.Tensor:
            pre, out = _experts_forward(rows, gate_up, down, route, math)
            saved_rows.append(rows)
            saved_pre.append(pre)
            return out

        expert_out = route_rows(hidden, True, plan, workspace, math, compute)  # caller holds the lease
        assert expert_out is not None
        hidden_size = hidden.shape[1]
        per_token = expert_out.view(tokens, top_k, hidden_size)
        weights = topk_weights.to(expert_out.dtype).view(tokens, 1, top_k)
        output = torch.bmm(weights, per_token).view(tokens, hidden_size)
        if any(ctx.needs_input_grad[:4]):
            # keep only what backward will read: the per-route outputs feed the routing-weight
            # gradient, the expert inputs and pre-activations the expert-side gradients
            ctx.save_for_backward(topk_weights, gate_up, down,
                                  expert_out if ctx.needs_input_grad[1] else None)
            ctx.saved_rows = saved_rows if plan.backward_dispatch else []
            ctx.saved_pre = saved_pre if plan.backward_dispatch else []
            ctx.plan = plan
            ctx.workspace = workspace
            ctx.math = math
            ctx.pending = workspace.pending_backward()
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        topk_weights, gate_up, down, expert_out = ctx.saved_tensors
        plan: RoutePlan = ctx.plan
        math: ExpertMath = ctx.math
        workspace: MoeWorkspace = ctx.workspace
        tokens, top_k = plan.num_tokens, plan.top_k
        hidden_size = gate_up.shape[1]
        grad = grad_output.to(gate_up.dtype).contiguous()
        need_hidden, need_weights, need_gate_up, need_down = ctx.needs_input_grad[:4]
        want_expert_weights = need_gate_up or need_down

        weights_grad: torch.Tensor | None = None

        def routing_weights_grad() -> None:
            nonlocal weights_grad
            if need_weights:
                weights_grad = torch.bmm(expert_out.view(tokens, top_k, hidden_size),
                                         grad.view(tokens, hidden_size, 1)).view(tokens, top_k)
                weights_grad = weights_grad.to(topk_weights.dtype)

        hidden_grad = gate_up_grad = down_grad = None
        # Whether gradient rows travel, and come back, is decided by every EP rank's needs
        # (agreed in the plan), so one rank's frozen weights cannot leave another waiting.
        if plan.backward_dispatch:
            route_weights = topk_weights.to(grad.dtype).reshape(tokens * top_k)
            weight_grads: list[torch.Tensor | None] = [None, None]
            deferred: list[WeightGrads | None] = [None]

            def compute(c: int, route: ChunkRoute, rows: torch.Tensor) -> torch.Tensor | None:
                out, deferred[0] = _experts_backward(ctx.saved_rows[c], ctx.saved_pre[c], rows, gate_up,
                                                     down, route, math, want_expert_weights,
                                                     plan.backward_combine)
                return out

            def expert_weight_grads(c: int) -> None:
                step, deferred[0] = deferred[0], None
                if step is not None:
                    gu, dn = step()
                    weight_grads[0] = _accumulate(weight_grads[0], gu)
                    weight_grads[1] = _accumulate(weight_grads[1], dn)

            with workspace.lease("backward"):
                back = route_rows(grad, True, plan, workspace, math, compute,
                                  return_results=plan.backward_combine, row_scale=route_weights,
                                  sum_over_k=True, after_dispatch=routing_weights_grad,
                                  after_combine=expert_weight_grads)
            if need_hidden:
                hidden_grad = back
            gate_up_grad, down_grad = weight_grads
            if want_expert_weights and gate_up_grad is None:  # no chunk at all
                gate_up_grad, down_grad = torch.zeros_like(gate_up), torch.zeros_like(down)
        else:
            routing_weights_grad()
        ctx.pending.release()
        return (hidden_grad, weights_grad, gate_up_grad if need_gate_up else None,
                down_grad if need_down else None, None, None, None)
