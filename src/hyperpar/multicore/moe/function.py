"""Forward and backward of the routed experts as two ``torch.library`` custom ops.

``hyperpar::moe_experts`` plans the call (one small all-gather), dispatches the rows,
runs the experts and combines; it returns the layer's output *and* the tensors its
backward needs (the rows each expert received and their pre-activations; the route
weights' gradient is taken on the expert side, so the per-route outputs are not kept).
Its registered autograd formula saves those with ``save_for_backward`` and
calls ``hyperpar::moe_experts_backward`` with them. So a ``TorchDispatchMode`` (an
``OffloadSession``) sees the layer as one op per direction whose saved activations are
ordinary outputs and inputs it can count, evict and page back, and
``saved_tensors_hooks`` see every saved byte. Everything either op returns is an owned
tensor, never a workspace view, and every collective has completed when it returns.

Dispatch, expert compute and combine run per piece (a chunk of tokens, or the part of
it one wave carries) with asynchronous all-to-alls, so while one piece's rows are on the
wire another is computed; backward walks the same route in reverse. What the schema
cannot carry (the route plan, the workspace, the process group) travels in a
``MoeCall`` registered under an integer key for the duration of one op call.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .combine import weighted_sum
from .grouped_gemm import grouped_mm, grouped_mm_cast, weight_grad_as
from .packing import Blocks
from .routing import ChunkRoute, GradNeeds, RoutePlan, RoutingSetup, build_route_plan
from .swiglu import swiglu_as, swiglu_backward_as
from .workspace import MoeWorkspace

Tensor = torch.Tensor


@dataclass(frozen=True)
class ExpertMath:
    swiglu_limit: float | None
    ep_size: int
    group: dist.ProcessGroup | None
    # opt-in: GEMM operands in this dtype (accumulated in float32 by the kernels); SwiGLU, the
    # sums over routes, outputs and gradients in the input's. What is a GEMM operand or result
    # anyway (the rows on the wire, the saved rows and pre-activations) is
    # kept in this dtype: the same values the input's dtype would hold, in fewer bytes.
    gemm_dtype: torch.dtype | None = None

    def gemm(self, t: Tensor) -> Tensor:
        """``t`` as a GEMM operand (itself without ``gemm_dtype``: no copy)."""
        return t if self.gemm_dtype is None else t.to(self.gemm_dtype)

    def wire(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype rows travel and are saved in for inputs of ``dtype``."""
        return dtype if self.gemm_dtype is None else self.gemm_dtype


class GemmWeights:
    """The expert weights as GEMM operands for one call. Without ``gemm_dtype`` (or with weights
    already in it) they are used as they are; with the opt-in each expert's weight is cast into a
    reused buffer right before its ``mm`` (``grouped_mm_cast``): no stack-sized copy is made, so
    none is held between GEMMs or while the weight gradients are taken."""

    def __init__(self, math: ExpertMath, gate_up: Tensor, down: Tensor) -> None:
        self._math = math
        self._weights = {"gate_up": gate_up, "down": down}

    def mm(self, rows: Tensor, name: str, route: ChunkRoute, transpose: bool = False) -> Tensor:
        """``rows`` times each group's ``name`` weight (transposed with ``transpose``)."""
        weight = self._weights[name]
        counts = route.expert_counts
        if self._math.gemm_dtype is None or weight.dtype == self._math.gemm_dtype:
            return grouped_mm(rows, weight.transpose(1, 2) if transpose else weight, counts,
                              route.expert_offsets)
        return grouped_mm_cast(rows, weight, counts, transpose)


@dataclass
class MoeCall:
    """The per-call state the custom ops cannot take as arguments."""

    setup: RoutingSetup
    workspace: MoeWorkspace
    math: ExpertMath
    needs: GradNeeds
    plan: RoutePlan | None = None
    wanted: tuple[bool, bool, bool, bool] = field(default=(False, False, False, False))  # backward


# The rows an expert rank receives depend on the routing: both ops say their output sizes
# are data-dependent (torch >= 2.7 takes tags on custom ops).
_OP_TAGS: dict[str, Any] = ({"tags": (torch.Tag.dynamic_output_shape,)}
                            if "tags" in inspect.signature(torch.library.custom_op).parameters else {})

_CALLS: dict[int, MoeCall] = {}
_ADD_BLOCK_ROWS = 512  # route_rows: returned rows widened for the route sum this many at a time
_KEYS = itertools.count(1)


@contextmanager
def _registered(call: MoeCall) -> Iterator[int]:
    key = next(_KEYS)
    _CALLS[key] = call
    try:
        yield key
    finally:
        del _CALLS[key]


def _exchange(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], math: ExpertMath) -> Any:
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=math.group, async_op=True)


def _experts_forward(rows: Tensor, weights: GemmWeights, route: ChunkRoute,
                     math: ExpertMath, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(pre-activation, output) in the rows' (wire) dtype; SwiGLU runs in ``dtype``, the input's."""
    pre = weights.mm(rows, "gate_up", route)
    act = swiglu_as(pre, dtype, math.swiglu_limit)  # in the wire dtype: a GEMM operand
    return pre, weights.mm(math.gemm(act), "down", route)


@dataclass
class PieceWeightGrads:
    """What one piece's expert weight gradients still need once its rows' gradient is on the
    wire back. ``down`` runs first (while the combine is in flight) and frees the gradient rows
    and the scaled activation; ``gate_up``, the step's largest allocation, runs after every
    exchange of the call completed, with the pre-activation gradient parked in the idle
    workspace, so the only large tensors alive beside the two gradients are the saved ones."""

    rows: Tensor
    pre_grad: Tensor
    act: Tensor | None  # route weight x activation
    grad: Tensor | None  # the received (unscaled) gradient rows
    route: ChunkRoute

    def down(self, dtype: torch.dtype) -> Tensor:
        assert self.act is not None and self.grad is not None
        counts, offsets = self.route.expert_counts, self.route.expert_offsets
        grad = weight_grad_as(dtype, self.act, self.grad, counts, offsets, blocks=4)
        self.act = self.grad = None
        return grad

    def gate_up(self, dtype: torch.dtype, workspace: MoeWorkspace) -> Tensor:
        """Its blocks are one group each, split in two by columns below 8 groups (measured on
        the coarse bench shape: 4 groups whole 4.5 ms, halves 5.5, quarters 6.5)."""
        pre_grad = self.pre_grad
        parked = workspace.scratch(pre_grad.shape[0], pre_grad.shape[1], pre_grad.dtype)
        if parked is not None:
            self.pre_grad = pre_grad = parked.copy_(pre_grad)  # the owned one is freed here
        counts, offsets = self.route.expert_counts, self.route.expert_offsets
        return weight_grad_as(dtype, self.rows, pre_grad, counts, offsets, blocks=max(8, len(counts)))


def _experts_backward(rows: Tensor, pre: Tensor, grad: Tensor, scale: Tensor, weights: GemmWeights,
                      route: ChunkRoute, math: ExpertMath, dtype: torch.dtype, want_weights: bool,
                      want_rows: bool, want_scale: bool,
                      ) -> tuple[Tensor | None, Tensor | None, PieceWeightGrads | None]:
    """The rows' gradient (in the wire dtype of ``rows``, ``pre`` and ``grad``), the route
    weights' gradient ([R] in ``dtype``, the input's) and the weight gradients still to take.
    ``grad`` holds the received rows of the output's gradient, not yet multiplied by their route
    weight ``scale``: SwiGLU's backward applies it (see ``swiglu_backward``)."""
    act_grad = weights.mm(grad, "down", route, transpose=True)
    # in the wire dtype from here on: only GEMMs read them
    pre_grad, act, scale_grad = swiglu_backward_as(pre, act_grad, dtype, math.swiglu_limit, scale,
                                                   want_activation=want_weights, want_scale_grad=want_scale)
    del act_grad
    rows_grad = None
    if want_rows:
        rows_grad = weights.mm(pre_grad, "gate_up", route, transpose=True)
    pending = PieceWeightGrads(rows, pre_grad, act, grad, route) if want_weights else None
    return rows_grad, scale_grad, pending


def _accumulate(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    if part is None:
        return total
    return part if total is None else total.add_(part)


def _waves(plan: RoutePlan) -> list[list[tuple[int, ChunkRoute]]]:
    waves: list[list[tuple[int, ChunkRoute]]] = [[] for _ in range(plan.waves)]
    for index, route in enumerate(plan.chunks):
        waves[route.wave].append((index, route))
    return waves


Compute = Callable[[int, ChunkRoute, Tensor, Tensor | None], tuple[Tensor | None, Tensor | None]]


def route_rows(
    source: Tensor, source_is_tokens: bool, plan: RoutePlan, workspace: MoeWorkspace,
    math: ExpertMath, compute: Compute, return_results: bool = True, row_values: Tensor | None = None,
    return_values: bool = False, sum_over_k: bool = False,
    after_combine: Callable[[int], None] | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Send rows of ``source`` to their experts, run ``compute(piece_index, route,
    expert_major_rows, expert_major_values) -> (expert_major_result, expert_major_result_values)``
    there, and bring the results back un-permuted: returns a new [T*K, H] tensor in (token, k)
    order (or nothing, without the return trip, when ``return_results`` is False). ``source``
    holds one row per token ([T, H]) or one per (token, k) pair ([T*K, H]). Rows travel, reach
    ``compute`` and come back in ``math.wire(source.dtype)``; the sum over routes is in the source's.

    ``row_values`` ([T*K], (token, k) order) travel with the rows, one value per row (the route
    weights); with ``return_values`` one value per row comes back too, returned [T*K] in
    (token, k) order (the route weights' gradient). ``sum_over_k`` returns the results summed
    over each token's routes ([T, H]) instead, accumulated straight from the returned rows
    without un-permuting them first. ``after_combine(i)`` runs once piece ``i``'s results are on
    the wire back (or, without the return trip, once it is computed): work that needs neither
    is hidden behind the communication."""
    total_rows = plan.num_tokens * plan.top_k
    hidden = source.shape[1]
    wire = math.wire(source.dtype)
    if source_is_tokens:
        source = source.to(wire)  # [T, H] cast once rather than every gathered row
    # Results are allocated only once the first piece's are back (not held while pieces are
    # computed): the summed one is accumulated piece by piece, the un-permuted one gathered in
    # one go (``plan.unsort``) once every piece's results are back.
    summing = return_results and sum_over_k
    result: Tensor | None = None
    values_back: list[Tensor] = []  # per piece, in its send order

    def add_up(tokens: Tensor, rows: Tensor) -> None:
        nonlocal result
        if result is None:
            result = source.new_zeros(plan.num_tokens, hidden)
        if rows.dtype == result.dtype:
            result.index_add_(0, tokens, rows)
            return
        # narrower rows (gemm_dtype opt-in) widened a block at a time, added in the same order
        for start in range(0, rows.shape[0], _ADD_BLOCK_ROWS):
            block = slice(start, start + _ADD_BLOCK_ROWS)
            result.index_add_(0, tokens[block], rows[block].to(result.dtype))

    def summed() -> Tensor:
        return source.new_zeros(plan.num_tokens, hidden) if result is None else result

    def gather(route: ChunkRoute, out: Tensor | None = None) -> Tensor:
        index = route.source_token if source_is_tokens else route.order
        if out is None:
            return source.index_select(0, index)
        return torch.index_select(source, 0, index, out=out)

    def unsorted(sorted_rows: Tensor) -> Tensor:
        """[T*K, ...] in (token, k) order from every piece's rows in piece order."""
        assert plan.unsort is not None
        return sorted_rows.index_select(0, plan.unsort)

    def results() -> tuple[Tensor | None, Tensor | None]:
        values = unsorted(_joined(values_back, source.new_empty(0, dtype=wire), 0)) if return_values else None
        return (summed() if summing else None), values

    if math.ep_size == 1:
        outs: list[Tensor] = []
        for c, route in enumerate(plan.chunks):
            values = None if row_values is None else row_values.index_select(0, route.order)
            out, out_values = compute(c, route, gather(route), values)
            if out_values is not None:
                values_back.append(out_values)
            if summing:
                assert out is not None
                add_up(route.source_token, out)
            elif return_results:
                assert out is not None
                outs.append(out)
            del out
            if after_combine is not None:
                after_combine(c)
        if return_results and not sum_over_k:
            return unsorted(_joined(outs, source.new_empty(0, dtype=wire), hidden)), None
        return results()

    # Each piece of a wave owns a disjoint slice of both buffers. Its received rows are
    # copied out (owned) before its results are written back into the same slice, and its
    # combine lands in its send slice after its dispatch completed: two buffers serve four
    # roles. A wave's combines complete before the next wave's rows reuse the receive buffer.
    # Values travel in the same exchanges, packed after each peer's rows (``packing``).
    assert not return_values or row_values is not None, "returned values take the sent values' dtype"
    waves = _waves(plan)
    layouts = {c: _PieceLayout.of(route, hidden * wire.itemsize, row_values, return_results, return_values)
               for c, route in enumerate(plan.chunks)}
    send_begin, recv_begin = _begins(waves, layouts)
    send_all, recv_all = workspace.exchange_buffers(
        total_rows, max(sum(r.recv_rows for _, r in wave) for wave in waves), hidden, wire,
        send_total=sum(layout.send_rows for layout in layouts.values()),
        recv_total=max(sum(layouts[c].recv_rows for c, _ in wave) for wave in waves))

    def views(c: int) -> tuple[Tensor, Tensor]:
        return (send_all[send_begin[c]:send_begin[c] + layouts[c].send_rows],
                recv_all[recv_begin[c]:recv_begin[c] + layouts[c].recv_rows])

    for wave in waves:
        dispatches = []
        for c, route in wave:
            send, recv = views(c)
            out_blocks, in_blocks = layouts[c].dispatch
            index = route.source_token if source_is_tokens else route.order
            for begin, first, count in out_blocks.spans():
                torch.index_select(source, 0, index[first:first + count], out=send[begin:begin + count])
            if row_values is not None:
                out_blocks.write_values(send, row_values.index_select(0, route.order))
            dispatches.append(_exchange(recv[:in_blocks.total], send[:out_blocks.total], in_blocks.splits,
                                        out_blocks.splits, math))
        combines = []
        for (c, route), work in zip(wave, dispatches, strict=True):
            send, recv = views(c)
            layout = layouts[c]
            work.wait()
            assert route.recv_to_expert is not None and route.expert_to_recv is not None
            received = layout.dispatch[1]
            to_expert = route.recv_to_expert
            values = None
            if row_values is not None:
                values = received.read_values(recv, row_values.dtype).index_select(0, to_expert)
            if received.packed:  # the rows skip the value rows between the peers' blocks
                to_expert = received.row_positions(to_expert.device).index_select(0, to_expert)
            out, out_values = compute(c, route, recv.index_select(0, to_expert), values)
            back_out, back_in = layout.combine
            if return_results or return_values:  # collective: also with nothing to send
                if return_results:  # back to source-major
                    assert out is not None
                    for begin, first, count in back_out.spans():
                        torch.index_select(out, 0, route.expert_to_recv[first:first + count],
                                           out=recv[begin:begin + count])
                if return_values:
                    assert out_values is not None and row_values is not None
                    back_out.write_values(recv, out_values.index_select(0, route.expert_to_recv)
                                          .to(row_values.dtype))
                combines.append(_exchange(send[:back_in.total], recv[:back_out.total], back_in.splits,
                                          back_out.splits, math))
            del out  # in the buffer now: not held while after_combine runs
            if after_combine is not None:
                after_combine(c)
        for work in combines:
            work.wait()
        for c, route in wave:
            back_in = layouts[c].combine[1]
            if summing:
                for begin, first, count in back_in.spans():
                    add_up(route.source_token[first:first + count], views(c)[0][begin:begin + count])
            if return_values:
                assert row_values is not None
                values_back.append(back_in.read_values(views(c)[0], row_values.dtype))
    if return_results and not sum_over_k:
        # every piece's results are in the send buffer, in piece order, with no value rows
        # between pieces (values sent out would leave gaps that ``plan.unsort`` does not know)
        assert row_values is None and not return_values, "un-permuted results travel without values"
        return unsorted(send_all), None
    return results()


@dataclass(frozen=True)
class _PieceLayout:
    """Both exchanges of one piece: (this rank's side, the peers' side) of the dispatch, then
    (the expert side, the token side) of the combine; a slice of each buffer fits the larger."""

    dispatch: tuple[Blocks, Blocks]
    combine: tuple[Blocks, Blocks]

    @staticmethod
    def of(route: ChunkRoute, row_bytes: int, row_values: Tensor | None, return_results: bool,
           return_values: bool) -> _PieceLayout:
        sent, received = route.send_splits, route.recv_splits
        none = [0] * len(sent)
        value_bytes = 0 if row_values is None else row_values.element_size()

        def blocks(rows: list[int], values: list[int]) -> Blocks:
            return Blocks.of(rows, values, row_bytes, value_bytes)
        there = row_values is not None
        return _PieceLayout(
            dispatch=(blocks(sent, sent if there else none), blocks(received, received if there else none)),
            combine=(blocks(received if return_results else none, received if return_values else none),
                     blocks(sent if return_results else none, sent if return_values else none)))

    @property
    def send_rows(self) -> int:
        return max(self.dispatch[0].total, self.combine[1].total)

    @property
    def recv_rows(self) -> int:
        return max(self.dispatch[1].total, self.combine[0].total)


def _begins(waves: list[list[tuple[int, ChunkRoute]]],
            layouts: dict[int, _PieceLayout]) -> tuple[dict[int, int], dict[int, int]]:
    """Each piece's first row in the send buffer (pieces one after another) and in the receive
    buffer (from the start again every wave); without values, the plan's own offsets."""
    send_begin: dict[int, int] = {}
    recv_begin: dict[int, int] = {}
    send = 0
    for wave in waves:
        recv = 0
        for c, _ in wave:
            send_begin[c], recv_begin[c] = send, recv
            send += layouts[c].send_rows
            recv += layouts[c].recv_rows
    return send_begin, recv_begin


def _joined(parts: list[Tensor], like: Tensor, width: int) -> Tensor:
    """One owned tensor of every piece's rows (no copy for a single piece); ``width`` 0: values."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return like.new_empty(0, width) if width else like.new_empty(0)
    return torch.cat(parts)


def _forward(call: MoeCall, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor,
             down: Tensor, tokens_per_expert: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    plan = call.plan = build_route_plan(call.setup, topk_ids, hidden.shape[0], tokens_per_expert,
                                        grad_needs=call.needs)
    math = call.math
    tokens, top_k = plan.num_tokens, plan.top_k
    hidden_size = hidden.shape[1]
    keep = plan.backward_dispatch  # some EP rank runs the expert-side backward
    saved_rows: list[Tensor] = []
    saved_pre: list[Tensor] = []
    weights = GemmWeights(math, gate_up, down)
    wire = math.wire(hidden.dtype)

    def compute(c: int, route: ChunkRoute, rows: Tensor, _: Tensor | None) -> tuple[Tensor, None]:
        pre, out = _experts_forward(rows, weights, route, math, hidden.dtype)
        if keep:
            saved_rows.append(rows)
            saved_pre.append(pre)
        return out, None

    expert_out, _ = route_rows(hidden, True, plan, call.workspace, math, compute)
    assert expert_out is not None
    output = weighted_sum(expert_out.to(hidden.dtype).view(tokens, top_k, hidden_size), topk_weights)
    like = hidden.new_empty(0, dtype=wire)
    return output, _joined(saved_rows, like, hidden_size), _joined(saved_pre, like, 2 * down.shape[1])


def _no_autocast(device: torch.device) -> torch.autocast:
    """The layer computes in its inputs' and weights' dtypes (and ``gemm_dtype``'s) whatever
    autocast region it is called in: a custom op's body would otherwise run its GEMMs under the
    caller's autocast and return bf16 for fp32 inputs, against the buffers and the saved
    tensors' dtypes it planned. ``gemm_dtype=torch.bfloat16`` is how to ask for bf16 GEMMs."""
    return torch.autocast(device.type, enabled=False)


@torch.library.custom_op("hyperpar::moe_experts", mutates_args=(), **_OP_TAGS)
def _moe_experts_op(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
                    tokens_per_expert: Tensor | None, call: int) -> tuple[Tensor, Tensor, Tensor]:
    """(output [T, H], expert input rows [R, H], pre-activations [R, 2I]); the last two are what
    backward reads, in the wire dtype (with the route weights and the output's gradient)."""
    with _no_autocast(hidden.device):
        return _forward(_CALLS[call], hidden, topk_ids, topk_weights, gate_up, down, tokens_per_expert)


@_moe_experts_op.register_fake
def _moe_experts_fake(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
                      tokens_per_expert: Tensor | None, call: int) -> tuple[Tensor, Tensor, Tensor]:
    ctx = torch.library.get_ctx()
    rows = ctx.new_dynamic_size()
    hidden_size = hidden.shape[1]
    state = _CALLS.get(call)
    wire = hidden.new_empty(0, dtype=hidden.dtype if state is None else state.math.wire(hidden.dtype))
    return (hidden.new_empty(hidden.shape), wire.new_empty(rows, hidden_size),
            wire.new_empty(rows, 2 * down.shape[1]))


def _backward(call: MoeCall, grad_output: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
              saved_rows: Tensor, saved_pre: Tensor) -> tuple[Tensor, ...]:
    plan, math, workspace = call.plan, call.math, call.workspace
    assert plan is not None
    tokens, top_k = plan.num_tokens, plan.top_k
    grad = grad_output.to(gate_up.dtype).contiguous()
    need_hidden, _, need_gate_up, need_down = call.wanted
    want_expert_weights = need_gate_up or need_down
    hidden_grad = weights_grad = gate_up_grad = down_grad = None
    # Which exchanges run is decided by every EP rank's needs (agreed in the plan), so one
    # rank's frozen weights cannot leave another waiting.
    if plan.backward_dispatch:
        route_weights = topk_weights.to(grad.dtype).reshape(tokens * top_k)
        down_grads: list[Tensor | None] = [None]
        pending: list[PieceWeightGrads] = []  # every piece's gate_up gradient, taken at the end
        weights = GemmWeights(math, gate_up, down)

        def compute(c: int, route: ChunkRoute, rows: Tensor, scale: Tensor | None,
                    ) -> tuple[Tensor | None, Tensor | None]:
            assert scale is not None
            piece = slice(route.saved_begin, route.saved_begin + route.recv_rows)
            out, scale_grad, grads = _experts_backward(
                saved_rows[piece], saved_pre[piece], rows, scale, weights, route, math, grad.dtype,
                want_expert_weights, plan.backward_combine, plan.backward_route_weights)
            if grads is not None:
                pending.append(grads)
            return out, scale_grad

        def down_weight_grad(c: int) -> None:  # while piece c's results are on the wire back
            if pending and pending[-1].grad is not None:
                down_grads[0] = _accumulate(down_grads[0], pending[-1].down(grad.dtype))

        with workspace.lease("backward"):
            hidden_sum, weights_grad = route_rows(
                grad, True, plan, workspace, math, compute, return_results=plan.backward_combine,
                row_values=route_weights, return_values=plan.backward_route_weights, sum_over_k=True,
                after_combine=down_weight_grad)
            # every exchange has completed: the workspace is idle and may hold the pre-activation
            # gradient while the largest gradient is taken
            while pending:
                gate_up_grad = _accumulate(gate_up_grad, pending.pop(0).gate_up(grad.dtype, workspace))
        if need_hidden:
            hidden_grad = hidden_sum
        del hidden_sum
        down_grad = down_grads[0]
        if want_expert_weights and gate_up_grad is None:  # no piece at all
            gate_up_grad, down_grad = torch.zeros_like(gate_up), torch.zeros_like(down)
        if weights_grad is not None:
            weights_grad = weights_grad.view(tokens, top_k).to(topk_weights.dtype)
    return tuple(g if g is not None and wanted else grad.new_empty(0)  # distinct: outputs may not alias
                 for g, wanted in zip((hidden_grad, weights_grad, gate_up_grad, down_grad), call.wanted,
                                      strict=True))


@torch.library.custom_op("hyperpar::moe_experts_backward", mutates_args=(), **_OP_TAGS)
def _moe_experts_backward_op(grad_output: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
                             saved_rows: Tensor, saved_pre: Tensor,
                             call: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (hidden, topk_weights, gate_up, down); [0] where not wanted."""
    call_state = _CALLS[call]
    with _no_autocast(grad_output.device):
        return _backward(call_state, grad_output, topk_weights, gate_up, down, saved_rows, saved_pre)


@_moe_experts_backward_op.register_fake
def _moe_experts_backward_fake(grad_output: Tensor, topk_weights: Tensor, gate_up: Tensor, down: Tensor,
                               saved_rows: Tensor, saved_pre: Tensor,
                               call: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ctx = torch.library.get_ctx()
    return (grad_output.new_empty(ctx.new_dynamic_size(), grad_output.shape[1]),
            topk_weights.new_empty(ctx.new_dynamic_size(), topk_weights.shape[1]),
            gate_up.new_empty(ctx.new_dynamic_size(), *gate_up.shape[1:]),
            down.new_empty(ctx.new_dynamic_size(), *down.shape[1:]))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    _, _, topk_weights, gate_up, down, _, key = inputs
    _, rows, pre = output
    call = _CALLS[key]
    ctx.call = call
    ctx.save_for_backward(topk_weights, gate_up, down, rows, pre)
    ctx.mark_non_differentiable(rows, pre)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the two saved outputs
    ctx.pending = call.workspace.pending_backward()  # close() refuses until backward ran or the graph died


def _backward_formula(ctx: Any, grad_output: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
    topk_weights, gate_up, down, rows, pre = ctx.saved_tensors
    call: MoeCall = ctx.call
    need_hidden, _, need_weights, need_gate_up, need_down, _, _ = ctx.needs_input_grad
    call.wanted = (need_hidden, need_weights, need_gate_up, need_down)
    if grad_output is None:
        grad_output = torch.zeros(call.plan.num_tokens if call.plan else 0, gate_up.shape[1],
                                  dtype=gate_up.dtype, device=gate_up.device)
    try:
        with _registered(call) as key:
            grads = torch.ops.hyperpar.moe_experts_backward(grad_output, topk_weights, gate_up, down,
                                                            rows, pre, key)
    finally:
        ctx.pending.release()
    hidden_grad, weights_grad, gate_up_grad, down_grad = (
        g if wanted else None for g, wanted in zip(grads, call.wanted, strict=True))
    return hidden_grad, None, weights_grad, gate_up_grad, down_grad, None, None


_moe_experts_op.register_autograd(_backward_formula, setup_context=_setup_context)


@torch.compiler.disable  # a graph break: the call key and the plan live outside any graph
def run_moe_experts(hidden: Tensor, num_tokens: int, topk_ids: Tensor, topk_weights: Tensor,
                    gate_up: Tensor, down: Tensor, tokens_per_expert: Tensor | None, call: MoeCall,
                    problems: list[str]) -> Tensor:
    """The layer's output [T, H] for ``hidden`` ([..., H], ``num_tokens`` rows). ``problems``
    are input errors the caller found: they are raised on every EP rank (the plan's exchange
    carries them) before any op runs."""
    with call.workspace.lease("forward"):  # the plan's collective must not interleave with another call's
        if problems:
            build_route_plan(call.setup, topk_ids, num_tokens, tokens_per_expert, problems, call.needs)
            raise AssertionError("build_route_plan returned despite input problems")  # pragma: no cover
        flat = hidden.reshape(num_tokens, hidden.shape[-1])
        with _registered(call) as key:
            return _moe_experts_op(flat, topk_ids, topk_weights, gate_up, down, tokens_per_expert, key)[0]
