"""In-place detection by schema: out= kwargs, tensor lists, non-tensor arguments first."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.capture import tensor_inputs, written_tensors
from hyperpar.offload.capture.ops.op_args import nested_tensors
from hyperpar.offload.ir import AccessKind

aten = torch.ops.aten


def _ids(tensors: list[torch.Tensor]) -> list[int]:
    return [id(t) for t in tensors]


def test_self_write() -> None:
    a, b = torch.ones(3), torch.ones(3)
    assert _ids(written_tensors(aten.add_.Tensor, (a, b), {})) == [id(a)]
    assert written_tensors(aten.add.Tensor, (a, b), {}) == []


def test_out_kwarg_with_tensor_list_input() -> None:
    a, b, out = torch.ones(2), torch.ones(2), torch.empty(4)
    args, kwargs = ([a, b], 0), {"out": out}
    assert _ids(written_tensors(aten.cat.out, args, kwargs)) == [id(out)]
    assert _ids(tensor_inputs(args, kwargs)) == [id(a), id(b), id(out)]


def test_written_tensor_list() -> None:
    xs, ys = [torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(3)]
    assert _ids(written_tensors(aten._foreach_add_.List, (xs, ys), {})) == _ids(xs)


def test_non_tensor_arguments_before_the_written_one() -> None:
    out = torch.empty(5)
    assert _ids(written_tensors(aten.arange.start_out, (0, 5, 1), {"out": out})) == [id(out)]
    t, idx, src = torch.zeros(4), torch.tensor([0, 1]), torch.ones(2)
    # index_put_(Tensor(a!) self, Tensor?[] indices, Tensor values, bool accumulate)
    assert _ids(written_tensors(aten.index_put_.default, (t, [idx], src, False), {})) == [id(t)]
    # scatter_.value(Tensor(a!) self, int dim, Tensor index, Scalar value): int between tensors
    assert _ids(written_tensors(aten.scatter_.value, (t, 0, idx, 1.0), {})) == [id(t)]


def test_trace_marks_the_right_storages_written() -> None:
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    x = torch.randn(4)
    with session:
        a = x * 2  # op 0: activation a
        b = x * 3  # op 1: activation b
        out = x.repeat(2)  # op 2: activation out
        torch.cat([a, b], out=out)  # op 3: reads a, b; writes out
        torch._foreach_mul_([a, b], 2.0)  # op 4: writes a and b
        torch.arange(0, 4, 1, out=b)  # op 5: non-tensor arguments first, writes b
    trace = session.trace
    assert trace is not None
    sid_a, sid_b, sid_out = (trace.guides[i].output_bindings[0] for i in range(3))
    kinds = [{acc.storage_id: acc.kind for acc in op.accesses} for op in trace.ops]
    assert kinds[3] == {sid_a: AccessKind.READ, sid_b: AccessKind.READ, sid_out: AccessKind.WRITE}
    assert kinds[4] == {sid_a: AccessKind.WRITE, sid_b: AccessKind.WRITE}
    assert kinds[5] == {sid_b: AccessKind.WRITE}
    assert trace.storage_sizes[sid_out] == 8 * 4
    assert trace.ops[3].name == "aten.cat.out"


def test_which_schemas_let_tensors_come_other_than_positionally() -> None:
    """Replay checks the inputs of the ops that say False in one pass over ``args``."""
    c10d = torch.ops.c10d
    nested = [aten.cat.default, aten.index.Tensor, aten.index_put_.default, aten.mm.out,
              aten._foreach_add_.List, aten.stack.default, c10d.allreduce_.default]
    flat = [aten.add.Tensor, aten.addmm.default, aten.native_layer_norm.default,
            aten.native_layer_norm_backward.default, aten.where.self, aten.copy_.default,
            aten.split_with_sizes.default, aten.view.default, aten._to_copy.default]
    assert [op for op in nested if not nested_tensors(op)] == []
    assert [op for op in flat if nested_tensors(op)] == []
    assert nested_tensors(lambda x: x)  # no schema: the general check


def test_positional_schema_tensors_are_exactly_the_args_tensors() -> None:
    """What makes the one-pass check sound: for a flat schema, every tensor input is a
    positional argument (optional tensors included)."""
    x, w, b = torch.randn(2, 4), torch.ones(4), torch.zeros(4)
    seen: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            seen.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Record():
        torch.nn.functional.layer_norm(x, (4,), w, b)
        torch.nn.functional.layer_norm(x, (4,), None, b)
        torch.add(x, x, alpha=2)
    for func, args, kwargs in seen:
        if not nested_tensors(func):
            positional = [a for a in args if isinstance(a, torch.Tensor)]
            assert _ids(tensor_inputs(args, kwargs)) == _ids(positional), func
