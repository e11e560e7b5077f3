"""Python reads of tensor bytes that no op shows the dispatcher: ``.tolist()``, ``.numpy()``...

``Tensor.tolist``, ``numpy``, ``__array__``, ``__dlpack__``, ``data_ptr``, ``item``,
``__reduce_ex__`` (pickle, ``torch.save``), ``__deepcopy__`` and the printing methods read a
storage's bytes without dispatching an op (or, for printing, with the dispatch modes
switched off), and so do the sparse constructors (``torch.sparse_coo_tensor`` and friends
check their index and value tensors in C++, also tensors they make on the way), so a
planned eviction could free those bytes under them. While any session
step runs these methods are wrapped: a tensor whose storage is an activation of the step
(found through the dispatch mode of the calling thread, which autograd's threads inherit)
is brought back to the device and pinned there for the rest of the step before the read.

From another thread the step may move an activation at any moment, so reading one that
is not pinned raises ``ActivationReadError`` instead of risking a crash: the methods above,
and ``detach``, ``clone``, ``cpu`` and ``to``, which a logger thread calls before reading a
tensor with ops. Pin it from the step's thread with ``OffloadSession.keep_on_device`` to
share it. Ops called on it directly in another thread (``h.sum()``) are not seen: the
dispatch mode is per thread. They are not supported and may crash.

There is no torch hook for these reads, hence the wrapping; it is installed at the first
step of a session and removed when no session that stepped is left (``dispatch_mode``'s
step hooks), and costs about a microsecond per call; outside a step a wrapper only calls
the original.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from hyperpar.offload.capture.mode import dispatch_mode
from hyperpar.offload.capture.mode.executor_base import ExecutorBase

_METHODS = ("tolist", "numpy", "__array__", "__dlpack__", "data_ptr", "item", "__reduce_ex__",
            "__deepcopy__", "__repr__", "__str__", "__format__")
# Methods another thread calls before reading a tensor with ops (``h.detach().sum()``): in
# the step's own thread their ops are seen, so these only guard other threads.
_OTHER_THREAD_METHODS = ("detach", "clone", "cpu", "to")
# Constructors that check their tensor arguments' values in C++ before any op is dispatched.
_FUNCTIONS = ("sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor",
              "sparse_bsc_tensor", "sparse_compressed_tensor")


class ActivationReadError(RuntimeError):
    """Another thread read an activation that a running offload step may move."""


_lock = threading.Lock()
_running: dict[int, tuple[ExecutorBase, int]] = {}  # id(executor) -> (executor, thread id)
_originals: dict[str, Any] = {}
_original_functions: dict[str, Any] = {}


def _install() -> None:
    for name in _METHODS:
        _originals[name] = torch.Tensor.__dict__.get(name)
        setattr(torch.Tensor, name, _guarded(getattr(torch.Tensor, name)))
    for name in _OTHER_THREAD_METHODS:
        _originals[name] = torch.Tensor.__dict__.get(name)
        setattr(torch.Tensor, name, _guarded(getattr(torch.Tensor, name), other_threads_only=True))
    for name in _FUNCTIONS:
        original = getattr(torch, name, None)
        if original is not None:
            _original_functions[name] = original
            setattr(torch, name, _guarded_function(original))


def _remove() -> None:
    for name, original in _originals.items():
        if original is None:
            delattr(torch.Tensor, name)
        else:
            setattr(torch.Tensor, name, original)
    _originals.clear()
    for name, original in _original_functions.items():
        setattr(torch, name, original)
    _original_functions.clear()


dispatch_mode.STEP_HOOKS.append((_install, _remove))


def step_started(ex: ExecutorBase) -> None:
    """From now on reads of ``ex``'s activations are guarded (the wrappers are installed)."""
    with _lock:
        _running[id(ex)] = (ex, threading.get_ident())


def step_ended(ex: ExecutorBase) -> None:
    with _lock:
        _running.pop(id(ex), None)


def _guarded(method: Any, other_threads_only: bool = False) -> Any:
    @functools.wraps(method)
    def guarded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _running:
            before_host_read(self, other_threads_only)
        return method(self, *args, **kwargs)

    return guarded


def _guarded_function(fn: Any) -> Any:
    """Pins the tensor arguments, then runs the constructor untouched by the step (what it
    makes on the way is never tracked, so never moved)."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not _running:
            return fn(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                before_host_read(a)
        mine = _this_threads_executor()
        if mine is None or mine.closed:
            return fn(*args, **kwargs)
        mine.passthrough += 1
        try:
            return fn(*args, **kwargs)
        finally:
            mine.passthrough -= 1

    return guarded


def _this_threads_executor() -> ExecutorBase | None:
    """The step whose dispatch mode this thread runs under (autograd threads inherit it), or
    the step started in this thread."""
    from hyperpar.offload.capture.mode.dispatch_mode import OffloadDispatchMode

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, OffloadDispatchMode):
            return mode.executor
    me = threading.get_ident()
    for ex, thread in list(_running.values()):
        if thread == me:
            return ex
    return None


def before_host_read(t: torch.Tensor, other_threads_only: bool = False) -> None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return
    mine = _this_threads_executor()
    if mine is not None and not mine.closed and not mine.passthrough:
        if not other_threads_only:
            mine.read_behind_dispatcher(storage)
        return
    for ex, thread in list(_running.values()):  # a finishing step too: it is restoring storages
        if ex is mine:
            continue
        sid = ex.table.lookup(storage)
        if sid is not None and sid not in ex.table.pinned:
            raise ActivationReadError(
                f"this tensor ({tuple(t.shape)}, {t.dtype}) is an activation of an OffloadSession "
                f"step running in thread {thread}, which may move it off the device at any moment; "
                f"read it in that thread, after the step, or pin it there first with "
                f"session.keep_on_device(tensor)"
            )
