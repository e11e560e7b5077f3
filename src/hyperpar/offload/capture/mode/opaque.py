"""skip_offload regions: one opaque op in forward, one in backward.

The region's function runs as it would without a session, its autograd nodes part of the
one graph (non-reentrant, like ``torch.utils.checkpoint(use_reentrant=False)``): nothing
calls ``autograd.backward`` inside a backward, so ``torch.autograd.grad`` through a region
returns what plain PyTorch returns, touches no ``.grad``, and gradients of an input also
used outside the region add up in the same order as without the region.

Inside, ops are not traced (evicted inputs are still paged in, and what they touch counts
as an access of the region's op), so data-dependent control flow or code the dispatcher
cannot see replays fine. In backward the region's op spans from the start of the first of
its autograd nodes (found by their sequence numbers) to the end of the last one that the
running backward executes (``torch._C._will_engine_execute_node``); whatever else the
engine runs in between (a parameter's gradient accumulation) is part of it. The op reads
the region's inputs and outputs, like a node that saved them, whatever the data made the
region save, so its accesses do not depend on the data either.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hyperpar.offload.capture.mode.executor_base import ExecutorBase, internal, untraced

Tensor = torch.Tensor
_sequence_nr = torch._C._autograd._get_sequence_nr
_will_execute = torch._C._will_engine_execute_node
_graph_task = torch._C._current_graph_task_id


def device_storages(ex: ExecutorBase, tensors: list[Any]) -> list[torch.UntypedStorage]:
    out = []
    for t in tensors:
        if isinstance(t, Tensor) and t.device == ex.device:
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # storage-less layouts
                continue
    return out


def run_opaque(ex: ExecutorBase, name: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``fn`` as one op of ``ex`` in forward, and its autograd nodes as one op in backward."""
    inputs = device_storages(ex, tree_leaves((args, kwargs)))
    with internal(ex):
        token = ex.begin_opaque(name, inputs)
    grad = torch.is_grad_enabled()
    first = _sequence_nr() if grad else 0
    with untraced(ex):
        out = fn(*args, **kwargs)
    outputs = [o for o in tree_leaves(out) if isinstance(o, Tensor)]
    with internal(ex):
        ex.end_opaque(token, outputs)
        if grad:
            _hook_region_nodes(ex, name + ".backward", outputs, inputs + device_storages(ex, outputs),
                               first, _sequence_nr())
    return out


class _RegionGraph:
    """A region's autograd nodes, and the opaque op they form while backward runs them."""

    __slots__ = ("done", "executor", "expected", "grads", "name", "nodes", "reads", "task", "token")

    def __init__(self, ex: ExecutorBase, name: str, nodes: list[Any],
                 reads: list[torch.UntypedStorage]) -> None:
        self.executor = weakref.ref(ex)
        self.name = name
        self.nodes = nodes  # strong: nodes take no weak references; dropped when the step ends
        self.reads = [weakref.ref(st) for st in reads]
        self.task = -1  # the backward (graph task) the counts below belong to
        self.expected = 0  # nodes of the region that this backward executes
        self.done = 0
        self.token: Any = None
        self.grads: list[weakref.ref] = []


def _hook_region_nodes(ex: ExecutorBase, name: str, outputs: list[Tensor],
                       reads: list[torch.UntypedStorage], first: int, end: int) -> None:
    if first == end:
        return
    def inside(node: Any) -> bool:  # made by the region (a leaf's node has the largest number)
        return node is not None and first <= node._sequence_nr() < end

    nodes, seen = [], set()
    stack = [o.grad_fn for o in outputs if inside(o.grad_fn)]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions if inside(nxt))
    if not nodes:
        return
    graph = _RegionGraph(ex, name, nodes, reads)
    ex.region_graphs.append(graph)
    before = functools.partial(_before_node, graph)
    for node in nodes:
        # The gradients this node sends out of the region are the region op's outputs.
        exits = tuple(k for k, (nxt, _) in enumerate(node.next_functions)
                      if nxt is not None and not inside(nxt))
        node.register_prehook(before)
        node.register_hook(functools.partial(_after_node, graph, exits))


def _before_node(graph: _RegionGraph, grad_outputs: tuple[Tensor | None, ...]) -> None:
    ex: ExecutorBase | None = graph.executor()
    if ex is None or ex.closed:
        return
    task = _graph_task()
    if task != graph.task:
        graph.task, graph.done, graph.grads = task, 0, []
        graph.expected = sum(1 for n in graph.nodes if _will_execute(n)) or len(graph.nodes)
    if graph.token is None and not ex.opaque_depth:
        held = [st for st in (r() for r in graph.reads) if st is not None]
        if held:  # those alive only because a copy holds them die first: what the region
            with internal(ex):  # reads must not depend on when copies end
                ex.manager.finish_copies_of(held)
            del held
        reads = [st for st in (r() for r in graph.reads) if st is not None]
        with internal(ex):
            graph.token = ex.begin_opaque(graph.name, reads + device_storages(ex, list(grad_outputs)))
        ex.opaque_depth += 1


def _after_node(graph: _RegionGraph, exits: tuple[int, ...], grad_inputs: tuple[Tensor | None, ...],
                grad_outputs: tuple[Tensor | None, ...]) -> None:
    ex: ExecutorBase | None = graph.executor()
    if ex is None:
        return
    graph.done += 1
    for k in exits:
        g = grad_inputs[k]
        if g is not None:
            graph.grads.append(weakref.ref(g))
    if graph.token is not None and graph.done >= graph.expected:
        token, graph.token = graph.token, None
        ex.opaque_depth -= 1
        grads, seen = [], set()
        for g in (r() for r in graph.grads):
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                grads.append(g)
        graph.grads = []
        if not ex.closed:
            with internal(ex):
                ex.end_opaque(token, grads)


def run_hop(ex: ExecutorBase, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A higher-order operator call (flex_attention, cond...) as one opaque op.

    The dispatch mode is off its stack while it handles the call, so the operator's inner
    ops are not seen: its reads are every tensor among its arguments (captured tensors of a
    score_mod or a branch come as arguments too), paged in before it runs. Its autograd
    runs above the mode: a backward arrives as another higher-order op.
    """
    name = "hop." + str(func.name() if callable(getattr(func, "name", None)) else func)
    inputs = device_storages(ex, tree_leaves((args, kwargs)))
    with internal(ex):
        token = ex.begin_opaque(name, inputs)
    with untraced(ex):
        out = func(*args, **kwargs)
    with internal(ex):
        ex.end_opaque(token, [o for o in tree_leaves(out) if isinstance(o, Tensor)])
    return out
