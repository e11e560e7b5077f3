"""The trace a step would record with some module calls rebuilt in backward, made from the
trace of the step without: so a choice of calls is judged by planning and projecting the
step it makes, before any step runs it.

A rebuilt call keeps what it was handed and frees, after its last forward use, each storage
it made that backward reads (``regions_of``'s freed bytes). In backward, just before the first
op that reads one of them, its ops run again: the same ops, accesses and sizes, the storages
they make under new ids (the rebuilt copies; a rebuilt storage nothing reads dies at once),
and backward's reads of the freed storages go to the copies. The real rebuilt step holds
each call's output gradients through that call's whole backward (``torch.autograd.grad``),
which the plain step's trace cannot show: this trace's activation peak is a little lower
than the real one (8-13 % on the models of ``test_rebuilt_trace``, which checks it against
the trace of the step as it really runs), its ops the same.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from hyperpar.offload.ir import ActivationTrace, TraceOp
from hyperpar.offload.ir.guide import OpGuide
from hyperpar.offload.ir.trace import StorageAccess


def rebuilt_bytes(trace: ActivationTrace, spans: list[tuple[int, int]], forward_end: int) -> int:
    """The bytes the calls of ``spans`` do not keep for backward (made again there)."""
    return sum(trace.storage_sizes.get(sid, 0) for sid in _rebuild(trace, spans, forward_end)[1])


Inserts = dict[int, list[tuple[int, int, dict[int, int]]]]


def _rebuild(trace: ActivationTrace, spans: list[tuple[int, int]], forward_end: int
             ) -> tuple[Inserts, dict[int, int], dict[int, int], set[int]]:
    """Per backward op, the spans run again before it (with their storages' new ids); each
    freed storage's copy; the sizes and pinned storages with the copies."""
    ops = trace.ops
    first: dict[int, int] = {}
    last_forward: dict[int, int] = {}
    first_backward: dict[int, int] = {}
    for i, op in enumerate(ops):
        for acc in op.accesses:
            sid = acc.storage_id
            first.setdefault(sid, i)
            if i < forward_end:
                last_forward[sid] = i
            else:
                first_backward.setdefault(sid, i)
    next_id = max(trace.storage_sizes, default=-1) + 1
    inserts: Inserts = defaultdict(list)
    rename: dict[int, int] = {}  # a freed storage -> its rebuilt copy (backward reads it)
    sizes = dict(trace.storage_sizes)
    pinned = set(trace.pinned_sids)
    for f, e in sorted(spans):
        made = [sid for sid, op in first.items() if f <= op < e]
        freed = [sid for sid in made if sid in first_backward and last_forward.get(sid, -1) < e
                 and sid not in trace.retained_sids and sid not in trace.pinned_sids]
        if not freed:
            continue
        copies = {}
        for sid in made:
            copies[sid] = next_id
            sizes[next_id] = sizes.get(sid, 0)
            if sid in trace.pinned_sids:
                pinned.add(next_id)
            next_id += 1
        inserts[min(first_backward[sid] for sid in freed)].append((f, e, copies))
        rename.update((sid, copies[sid]) for sid in freed)
    return inserts, rename, sizes, pinned


def rebuilt_trace(trace: ActivationTrace, spans: list[tuple[int, int]], forward_end: int) -> ActivationTrace:
    """``trace`` with the calls of ``spans`` (first op, end op: forward ops, not overlapping)
    rebuilt in backward; backward starts at op ``forward_end``."""
    ops = trace.ops
    inserts, rename, sizes, pinned = _rebuild(trace, spans, forward_end)
    if not rename:
        return trace
    guides = trace.guides if len(trace.guides) == len(ops) else None
    out_ops: list[TraceOp] = []
    out_guides: list[OpGuide] = []

    def emit(i: int, ids: dict[int, int]) -> None:
        op = ops[i]
        k = len(out_ops)
        out_ops.append(TraceOp(op.name, op.duration_ms, tuple(
            StorageAccess(k, ids.get(a.storage_id, a.storage_id), a.kind) for a in op.accesses)))
        if guides is not None:
            g = guides[i]
            bindings = {leaf: ids.get(s, s) for leaf, s in g.output_bindings.items()}
            inputs = tuple(ids.get(s, s) for s in g.input_sids)
            out_guides.append(replace(g, output_bindings=bindings, input_sids=inputs))

    for i in range(len(ops)):
        for f, e, copies in inserts.get(i, ()):
            for j in range(f, e):
                emit(j, copies)
        emit(i, rename if i >= forward_end else {})
    deaths = {sid: op for sid, op in trace.death_ops.items() if sid not in rename}
    offset = _shifts(inserts, len(ops))
    deaths = {sid: op + offset[min(op, len(ops) - 1)] for sid, op in deaths.items()}
    return replace(trace, ops=out_ops, storage_sizes=sizes, guides=out_guides if guides is not None else [],
                   pinned_sids=frozenset(pinned), death_ops=deaths, tail_sids=frozenset())


def _shifts(inserts: Inserts, n: int) -> list[int]:
    """Per original op, how many rebuilt ops come before it in the new trace."""
    shift, out = 0, []
    for i in range(n):
        shift += sum(e - f for f, e, _ in inserts.get(i, ()))
        out.append(shift)
    return out
