"""The TorchDispatchMode that routes every aten op of a session step to its executor.

Besides aten ops the mode takes two things other dispatch modes refuse:

- **Higher-order operators** (``flex_attention``, ``cond``, ``while_loop``...): the mode
  opts in (``supports_higher_order_operators``) and runs each call as one opaque op whose
  reads are the call's tensor inputs (``opaque.run_hop``). The operator's own autograd sits
  above the mode, so its backward arrives as another higher-order op, read the same way.
- **torch.compile**: Dynamo compiles and runs compiled code under the mode
  (``ignore_compile_internals``). Compiled kernels read and write memory behind the
  dispatcher, so compiled code may only run inside a *compiled region*
  (``compiled.run_compiled``): a ``torch.compile(module)`` call (found automatically) or a
  compiled callable wrapped in ``skip_offload``. A compiled frame that starts anywhere else
  raises ``OffloadCompileError`` before it runs, naming what to do, instead of running on
  evicted memory or silently eager. The eager paths of ``flex_attention`` and ``cond``
  compile their own operator internally (with the ``eager`` backend, every op still
  dispatched); those compiles are allowed.

- **Tensor subclasses** with their own ``__torch_dispatch__`` (DTensor, nested jagged
  tensors): the mode returns ``NotImplemented`` for an op on one, the subclass runs it, and
  the ops it calls on the plain tensors it holds come back to the mode (docs/works_with.md).

How Dynamo asks: when it is about to compile a frame it calls ``ignore_compile_internals``
on every dispatch mode on the thread's stack; a compiled frame that hits Dynamo's cache
runs without asking, so while a step runs a guard-complete hook turns such a cache hit
under the offload mode into a miss, which asks.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
)

from hyperpar.offload.capture.mode.executor_base import ExecutorBase
from hyperpar.offload.capture.mode.opaque import run_hop
from hyperpar.offload.capture.ops.errors import OffloadCompileError

try:  # torch >= 2.7: HOPs compile their eager path inside this flag
    from torch._higher_order_ops.utils import _in_hop_compile
except ImportError:  # pragma: no cover - older torch
    def _in_hop_compile() -> bool:
        return False

try:
    from torch._C._dynamo.eval_frame import set_guard_complete_hook
except ImportError:  # pragma: no cover - older torch: cache hits are not checked
    set_guard_complete_hook = None

_infra_mode = torch._C._get_dispatch_mode
_modes_below = torch._C._len_torch_dispatch_stack  # infra modes included; ours is off it in an op
_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame
_NO_KWARGS: dict[str, Any] = {}  # never written to: ops take ``**kwargs`` copies
# Autograd detaches each output it saves through saved-tensor hooks (the session's are on in
# every step): a view that reads no bytes and makes no storage, run as is, neither traced nor
# checked (it was 11 % of a traced HF Llama layer's ops)
_DETACH = torch.ops.aten.detach.default
# What OpOverload.__call__ calls: one Python frame less on every detach (a third of tiny ops' calls)
_DETACH_CALL = _DETACH._op if type(_DETACH).__call__ is OpOverload.__call__ else _DETACH
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_state = threading.local()  # .entering: this thread is pushing an offload mode
_lock = threading.Lock()
_steps = 0  # offload modes on any thread's stack now
_prior_hook: Any = None
# (install, remove) pairs of what sessions wrap on torch (compiled.py: OptimizedModule.__call__,
# native_callers.py, host_reads.py: Tensor methods). Installed at the first step of the first
# session and removed when the last session that stepped is gone, not per step: patching a
# torch class costs ~0.1 ms and invalidates attribute caches of every tensor type, which
# made a small step's enter and exit ~1 ms. Every wrapper does nothing outside a step.
STEP_HOOKS: list[tuple[Callable[[], None], Callable[[], None]]] = []
_holders = 0  # live sessions that have installed the hooks


def hold_step_hooks(owner: object) -> None:
    """Install ``STEP_HOOKS`` (if no one has) for as long as ``owner`` lives."""
    global _holders
    with _lock:
        if _holders == 0:
            for install, _ in STEP_HOOKS:
                install()
        _holders += 1
    weakref.finalize(owner, _release_step_hooks)


def _release_step_hooks() -> None:
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0:
            for _, remove in reversed(STEP_HOOKS):
                remove()

COMPILE_ERROR = (
    "torch.compile'd code started inside an OffloadSession step outside a compiled region. "
    "Compiled kernels read memory without going through the dispatcher, so the session must "
    "know where a compiled region starts: modules compiled with torch.compile(module) are "
    "found automatically; wrap any other compiled callable (a torch.compile'd function, a "
    "module compiled in place with module.compile()) in hyperpar.offload.skip_offload, e.g. "
    "`block = skip_offload(torch.compile(block_fn))`, or call it outside the session. "
    "See docs/works_with.md."
)


_DISABLED_DISPATCH = torch._C._disabled_torch_dispatch_impl
_dispatching: dict[type, bool] = {}  # tensor type -> defines its own __torch_dispatch__


_dispatching_sets: dict[Any, bool] = {}  # ``types`` as torch passes it -> any of them dispatching


def _any_dispatching_subclass(types: Any) -> bool:
    """Whether a tensor type of an op's arguments handles ops itself (``torch.Tensor`` and
    ``nn.Parameter`` appear in ``types`` too, with torch's disabled handler). The answer is
    kept per ``types`` (a tuple of a few types, cheap to hash), so a step asks once."""
    for kind in types:
        own = _dispatching.get(kind)
        if own is None:
            handler = getattr(kind, "__torch_dispatch__", _DISABLED_DISPATCH)
            own = _dispatching[kind] = handler is not _DISABLED_DISPATCH
        if own:
            return True
    return False


def _dispatching_set(types: Any) -> bool:
    """``_any_dispatching_subclass``, remembered for this ``types``."""
    own = _dispatching_sets[types] = _any_dispatching_subclass(types)
    return own


class OffloadDispatchMode(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, executor: ExecutorBase, session: Any = None) -> None:
        super().__init__()
        self.executor = executor
        self.session = session

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Dynamo compiles under this mode only where it allows (see ``ignore_compile_internals``)
        and never reaches our dispatch code with a callback set (``_outside_dynamo``), so torch's
        per-op wrapper that keeps it out would only cost time."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if _eval_frame_callback():
            return self._outside_dynamo(func, types, args, kwargs)
        if _modes_below() and (_infra_mode(_FAKE) is not None or _infra_mode(_PROXY) is not None):
            # Torch is tracing (a higher-order op's autograd builds its graphs on fake tensors
            # in eager): those ops, and any copy we would issue now, are not real.
            return func(*args, **(kwargs or {}))
        if types and func.__class__ is OpOverload:
            own = _dispatching_sets.get(types)
            if own is None:
                own = _dispatching_set(types)
            if own:
                # A tensor subclass with its own dispatch (a nested jagged tensor, a DTensor, a
                # quantized weight) takes the op first and calls ops on the plain tensors it
                # holds, which come back here: the session sees, counts and pages in every
                # plain tensor read. Run as one op, its inner reads would be invisible, and a
                # plain tensor the step also reads directly (``nt.values()``) could be evicted.
                return NotImplemented
        if func is _DETACH:
            return _DETACH_CALL(*args, **(kwargs or _NO_KWARGS))
        ex = self.executor
        if func.__class__ is not OpOverload and isinstance(func, HigherOrderOperator):
            if not (ex.passthrough or ex.opaque_depth or ex.closed):
                return run_hop(ex, func, args, kwargs or {})
        if ex.passthrough or ex.opaque_depth:
            return ex.dispatch(func, types, args, kwargs)
        return ex.run_op(func, args, kwargs or _NO_KWARGS)  # the common case, one call less

    def _outside_dynamo(self, func: Any, types: Any, args: tuple[Any, ...],
                        kwargs: dict[str, Any] | None) -> Any:
        """An op from code Dynamo runs eagerly inside a compiled function's call: keep Dynamo
        out of our own frames, as torch's per-op wrapper would."""
        prior = _set_eval_frame(None)
        try:
            return self.__torch_dispatch__(func, types, args, kwargs)
        finally:
            _set_eval_frame(prior)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo asks this before compiling a frame while the mode is on the stack."""
        if getattr(_state, "entering", False) or _in_hop_compile():
            return True
        raise OffloadCompileError(COMPILE_ERROR)

    def __enter__(self) -> OffloadDispatchMode:
        global _steps, _prior_hook
        with _lock:
            if _steps == 0:
                if set_guard_complete_hook is not None:
                    _prior_hook = set_guard_complete_hook(_cache_hit_check)
            _steps += 1
        with _entering():
            super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _steps, _prior_hook
        try:
            super().__exit__(*exc)
        finally:
            with _lock:
                _steps -= 1
                if _steps == 0:
                    if set_guard_complete_hook is not None:
                        set_guard_complete_hook(_prior_hook)
                        _prior_hook = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Take the mode off this thread's stack for a block (a compiled region runs there)."""
        top = _get_current_dispatch_mode()
        if top is not self:
            raise OffloadCompileError(
                f"a compiled region needs the offload dispatch mode on top of the dispatch mode "
                f"stack, but {type(top).__name__} is above it; enter that mode outside the "
                f"OffloadSession, or call the compiled code outside the session"
            )
        TorchDispatchMode.__exit__(self, None, None, None)
        try:
            yield
        finally:
            with _entering():
                TorchDispatchMode.__enter__(self)


@contextlib.contextmanager
def _entering() -> Iterator[None]:
    before = getattr(_state, "entering", False)
    _state.entering = True
    try:
        yield
    finally:
        _state.entering = before


def _cache_hit_check(cache_hit: bool) -> bool:
    """Dynamo's guard-complete hook: a cached compiled frame about to run under the offload
    mode counts as a miss, so that Dynamo asks ``ignore_compile_internals`` (which raises).
    Raising here instead would abort the process (the hook is called from C++)."""
    prior = _prior_hook
    if prior is not None:
        cache_hit = prior(cache_hit)
    if cache_hit and current_offload_mode() is not None and not _in_hop_compile():
        return False
    return cache_hit


def current_offload_mode() -> OffloadDispatchMode | None:
    """The offload mode this thread's ops go through now, if any.

    The dispatch mode stack is thread-local state that autograd hands to the threads it runs
    backward on, so this also finds the session from a backward hook on a device thread,
    where a context variable set by the step's thread would not be visible.
    """
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, OffloadDispatchMode):
            return mode
    return None
