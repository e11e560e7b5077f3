"""In-place detection by schema: out= kwargs, tensor lists, non-tensor arguments first."""

from __future__ import annotations

import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.capture import tensor_inputs, written_tensors
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
