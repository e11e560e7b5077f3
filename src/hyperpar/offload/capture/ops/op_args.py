"""Which tensors an op reads, which it writes (from its schema), and what it returned."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

Tensor = torch.Tensor

# func -> ((schema position, argument name, kwarg-only), ...) for arguments marked (a!).
_WRITE_SPECS: dict[Any, tuple[tuple[int, str, bool], ...]] = {}
# func -> whether a tensor can come other than as a positional argument (see ``nested_tensors``)
_NESTED: dict[Any, bool] = {}


def _add_sequence(out: list[Tensor], seq: list[Any] | tuple[Any, ...]) -> None:
    """Tensors of a (possibly nested) list: ``Tensor[][]`` as collectives take (all_gather)."""
    for b in seq:
        if isinstance(b, Tensor):
            out.append(b)
        elif isinstance(b, (list, tuple)):
            _add_sequence(out, b)


def tensor_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """Tensors among args and kwargs, including those inside tensor lists (cat, collectives)."""
    out: list[Tensor] = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            _add_sequence(out, a)
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                _add_sequence(out, a)
    return out


def nested_tensors(func: Any) -> bool:
    """Whether the op's schema lets a tensor arrive inside a list or as a keyword-only argument.

    When it does not, the tensors among its arguments are exactly the tensors in ``args`` (at
    dispatch, positional schema arguments come in ``args``; a ``Scalar`` is never a tensor), so
    replay checks its inputs with one pass over ``args``. Ops without a schema say True.
    """
    nested = _NESTED.get(func)
    if nested is None:
        schema = getattr(func, "_schema", None)
        nested = schema is None or any(
            _holds_tensor(arg.type) and (arg.kwarg_only or _in_list(arg.type))
            for arg in schema.arguments)
        _NESTED[func] = nested
    return nested


def _unwrap(t: Any) -> Any:
    while t.kind() == "OptionalType":
        t = t.getElementType()
    return t


def _in_list(t: Any) -> bool:
    return _unwrap(t).kind() in ("ListType", "TupleType", "AnyType")


def _holds_tensor(t: Any) -> bool:
    t = _unwrap(t)
    kind = t.kind()
    if kind == "ListType":
        return _holds_tensor(t.getElementType())
    if kind == "TupleType":
        return any(_holds_tensor(e) for e in t.elements())
    return kind in ("TensorType", "AnyType")


def _write_spec(func: Any) -> tuple[tuple[int, str, bool], ...]:
    spec = _WRITE_SPECS.get(func)
    if spec is None:
        schema = getattr(func, "_schema", None)
        spec = tuple(
            (pos, arg.name, bool(arg.kwarg_only))
            for pos, arg in enumerate(schema.arguments if schema is not None else ())
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        _WRITE_SPECS[func] = spec
    return spec


def mutates(func: Any) -> bool:
    """Whether the op's schema marks any argument as written (``(a!)``)."""
    return bool(_write_spec(func))


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """Tensors the op mutates, matched to the schema by position and by name.

    Positional schema arguments are looked up in ``args`` by their schema position (so a
    non-tensor argument before a tensor shifts nothing), kwarg-only ones such as ``out``
    in ``kwargs`` by name; a mutated tensor list (``_foreach_add_``) yields every tensor.
    """
    out: list[Tensor] = []
    for pos, name, kwarg_only in _write_spec(func):
        if not kwarg_only and pos < len(args):
            value = args[pos]
        else:
            value = kwargs.get(name)
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            _add_sequence(out, value)
    return out


def output_leaves(out: Any) -> list[Any]:
    """The op's result as a flat list of leaves (fast path for a tensor or tensor tuple)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(o, Tensor) for o in out):
        return list(out)
    return tree_leaves(out)


def storage_of(t: Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None
