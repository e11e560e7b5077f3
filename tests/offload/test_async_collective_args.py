"""Nested tensor lists (``Tensor[][]``, as collectives take) are found, so evicted or in-flight
storages among them are paged in or waited on before the op writes them."""

from __future__ import annotations

import torch

from hyperpar.offload.capture.ops.op_args import tensor_inputs, written_tensors


def test_nested_tensor_lists_are_inputs() -> None:
    a, b, c, d = (torch.zeros(2) for _ in range(4))
    found = tensor_inputs(([[a, b], [c]], 3, "x"), {"extra": [[d]]})
    assert [id(t) for t in found] == [id(a), id(b), id(c), id(d)]


def test_nested_mutated_tensor_lists_are_written() -> None:
    class _Schema:
        def __init__(self) -> None:
            alias = type("Alias", (), {"is_write": True})()
            self.arguments = [type("Arg", (), {"alias_info": alias, "name": "out", "kwarg_only": False})()]

    class _Op:
        _schema = _Schema()

    a, b = torch.zeros(1), torch.zeros(1)
    assert [id(t) for t in written_tensors(_Op(), ([[a], [b]],), {})] == [id(a), id(b)]
