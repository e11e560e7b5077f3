"""Compiled regions: torch.compile'd code inside a session step runs compiled, as one op.

A compiled region is a call of a ``torch.compile(module)`` (found automatically: while
steps run, ``OptimizedModule.__call__`` is wrapped) or of a compiled callable wrapped in
``skip_offload``. It is one opaque op of the step:

- **forward**: every tensor argument is paged in, then the offload dispatch mode is taken
  off the stack for the call, so Dynamo compiles and the compiled kernels run exactly as
  without a session (nothing they touch is moved while they run). What the region saves
  for backward is recorded through saved-tensor hooks: each saved tensor that the region
  made becomes an output of the region's op, an activation like any other, which the plan
  may move to host between the forward and the backward;
- **backward**: the region's autograd nodes (AOTAutograd's compiled backward, and any
  eager node a graph break left) form one opaque op, as for ``skip_offload``; it reads the
  region's inputs, outputs and saved activations, so all of them are on the device when
  the compiled backward starts. That backward is not a Dynamo frame: it runs with the
  mode on the stack, and its dispatched ops are paged in like any region's.

What a region reads must reach it as an argument (or be a parameter, buffer or a tensor it
made): an activation it finds through a closure or a global is not paged in for the
forward. Tensors saved for backward that existed before the region (parameters, buffers,
constants) are never moved.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hyperpar.offload.capture.mode import dispatch_mode
from hyperpar.offload.capture.mode.executor_base import ExecutorBase, internal
from hyperpar.offload.capture.mode.guard_stack import guard_lifted
from hyperpar.offload.capture.mode.opaque import _hook_region_nodes, device_storages

Tensor = torch.Tensor
_sequence_nr = torch._C._autograd._get_sequence_nr


def is_compiled(fn: Any) -> bool:
    """Whether calling ``fn`` runs torch.compile'd code at its top: ``torch.compile(module)``,
    ``torch.compile(fn)``, or a module compiled in place with ``module.compile()``."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(fn, OptimizedModule):
        return True
    if isinstance(fn, torch.nn.Module):
        return getattr(fn, "_compiled_call_impl", None) is not None
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


def run_compiled(ex: ExecutorBase, mode: dispatch_mode.OffloadDispatchMode, name: str, fn: Any,
                 args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module | None = None) -> Any:
    """Run ``fn`` (compiled) with the mode suspended, as one op forward and one op backward.

    The saved tensors of a compiled *module* are tracked (its parameters, buffers and tensor
    attributes are known, so what is left was made by the call); a compiled function's are
    left alone (whatever it captured, a frozen weight or a constant, is not known here).
    """
    inputs = device_storages(ex, tree_leaves((args, kwargs)))
    if ex.opaque_depth:  # inside another region: only bring its arguments in
        with internal(ex):
            kinds = ex.classify_inputs(_tensors(args, kwargs), [], False)[0]
            ex._bring_in(kinds)
        with mode.suspended(), guard_lifted():
            return fn(*args, **kwargs)
    with internal(ex):
        token = ex.begin_opaque(name, inputs)
    grad = torch.is_grad_enabled()
    first = _sequence_nr() if grad else 0
    saved: list[Tensor] = []
    ex.opaque_depth += 1
    try:
        with mode.suspended(), guard_lifted():  # (the session's own saved-tensor guard steps aside)
            hooks = (torch.autograd.graph.saved_tensors_hooks(_collect(saved), _same)
                     if grad and module is not None and not _outer_hooks() else contextlib.nullcontext())
            with hooks:
                out = fn(*args, **kwargs)
    finally:
        ex.opaque_depth -= 1
    outputs = [o for o in tree_leaves(out) if isinstance(o, Tensor)]
    made, earlier = _split_saved(ex, saved, inputs, outputs, module)
    del saved
    with internal(ex):
        ex.end_opaque(token, outputs + made)
        if grad:
            reads = inputs + device_storages(ex, outputs + made) + earlier
            _hook_region_nodes(ex, name + ".backward", outputs, reads, first, _sequence_nr())
    return out


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]


def _collect(saved: list[Tensor]) -> Any:
    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    return pack


def _same(t: Tensor) -> Tensor:
    return t


def _outer_hooks() -> bool:
    """Saved-tensor hooks already active (a checkpoint, the user's own): they own the saves."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - older torch: do not risk overriding them
        return True
    return top(False) is not None


def _split_saved(ex: ExecutorBase, saved: list[Tensor], inputs: list[torch.UntypedStorage],
                 outputs: list[Tensor], module: torch.nn.Module | None,
                 ) -> tuple[list[Tensor], list[torch.UntypedStorage]]:
    """(saved tensors the region made: new activations; storages of earlier activations it
    saved without receiving them as arguments: read by its backward)."""
    if not saved:
        return [], []
    seen = {id(st) for st in inputs}
    for o in outputs:
        for st in device_storages(ex, [o]):
            seen.add(id(st))
    if module is not None:
        for st in device_storages(ex, _owned_tensors(module)):
            seen.add(id(st))
    made: list[Tensor] = []
    earlier: list[torch.UntypedStorage] = []
    for t in saved:
        if not isinstance(t, Tensor) or t.device != ex.device or isinstance(t, torch.nn.Parameter):
            continue
        if t.requires_grad and t.is_leaf:
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if id(st) in seen:
            continue
        seen.add(id(st))
        if ex.table.lookup(st) is not None:
            earlier.append(st)
        elif not _plain(ex, st):
            made.append(t)
    return made, earlier


def _owned_tensors(module: torch.nn.Module) -> list[Tensor]:
    """Every tensor a module and its submodules hold: parameters, buffers, plain attributes."""
    out: list[Tensor] = []
    for sub in module.modules():
        out.extend(sub._parameters.values() if sub._parameters else ())
        out.extend(sub._buffers.values() if sub._buffers else ())
        out.extend(v for v in vars(sub).values() if isinstance(v, Tensor))
    return [t for t in out if t is not None]


def _plain(ex: ExecutorBase, st: torch.UntypedStorage) -> bool:
    """Seen earlier as an input that no op of the step made (a parameter, a user's tensor)."""
    ref = ex._plain.get(id(st))
    return ref is not None and ref() is st


# --- torch.compile(module): found automatically while steps run ----------------------
_original_call: Any = None


def _compiled_module_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    mode = dispatch_mode.current_offload_mode()
    ex = mode.executor if mode is not None else None
    if ex is None or ex.closed or ex.passthrough:
        return _original_call(self, *args, **kwargs)
    name = f"compiled({type(self._orig_mod).__qualname__})"
    return run_compiled(ex, mode, name, functools.partial(_original_call, self), args, kwargs,
                        module=self)


def _wrap_optimized_module() -> None:
    global _original_call
    from torch._dynamo.eval_frame import OptimizedModule

    _original_call = OptimizedModule.__call__
    OptimizedModule.__call__ = functools.wraps(_original_call)(_compiled_module_call)


def _unwrap_optimized_module() -> None:
    global _original_call
    from torch._dynamo.eval_frame import OptimizedModule

    if "__call__" in OptimizedModule.__dict__ and _original_call is not None:
        if _original_call is torch.nn.Module.__call__:
            del OptimizedModule.__call__
        else:
            OptimizedModule.__call__ = _original_call
    _original_call = None


dispatch_mode.STEP_HOOKS.append((_wrap_optimized_module, _unwrap_optimized_module))
