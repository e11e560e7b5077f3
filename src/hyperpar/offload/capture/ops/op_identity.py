"""What kind of op a dispatched function is, and the names traces record, cached per function.

On every op's path of warmup: each is computed once per function (or dtype) and looked up after.
"""

from __future__ import annotations

from typing import Any

import torch

# func -> how the op treats its buffers.
PLAIN, COLLECTIVE = 0, 1
_KIND: dict[Any, int] = {}
# fsdp: FSDP2's all-gather copy-in/out and reduce-scatter chunk_cat, whose buffers it frees and
# re-allocates itself with storage.resize_ (behind the dispatcher): never ours to move.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "fsdp"})
_NAMES: dict[Any, str] = {}
DTYPE_NAMES: dict[torch.dtype, str] = {}  # dtype -> str(dtype), as output meta records it


def op_kind(func: Any) -> int:
    kind = _KIND.get(func)
    if kind is None:
        namespace = getattr(func, "namespace", None)
        kind = _KIND[func] = COLLECTIVE if namespace in _COLLECTIVE_NAMESPACES else PLAIN
    return kind


def op_name(func: Any) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


def dtype_name(dtype: torch.dtype) -> str:
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        name = DTYPE_NAMES[dtype] = str(dtype)
    return name

