"""Recompute, executed: the module calls a plan rebuilds in backward, while a step runs.

The plan names module instances (the calls a checked replay saw); for the step their
``forward`` is replaced on the instance, and put back when the step ends, however it ends.
Each call then runs as one autograd Function (``_Rebuilt``): forward without keeping what it
saves, its tensor inputs saved through autograd's saved-tensor hooks (a session's fast path
sees them as saved tensors and can offload them; a write to one since forward raises at
backward, as for any saved tensor), and in backward it runs again from them with the
random-number and autocast state forward had, so a rebuilt tensor is bitwise the one forward
made. The buffers a call writes (BatchNorm's running statistics) are put back after the
run in backward as forward left them (``_StateKept``), and a call that writes a storage made
before it (its input) is never chosen (``planning.levers``). Two guards keep a second run
honest: a call handed an object it could change (a KV
cache) is not rebuilt, and on a checked step every rebuilt output is compared with its
forward bytes (a sum of its words, compared on the device and read once when the step ends:
no synchronization per call, and the step raises before its gradients are used). The session
checks the first step of a choice, and every step with ``verify=True``: the sums cost about
four ops per output, a real share of a host-bound step. They run out of the dispatch modes'
sight, so a step traces the same ops whether it checks or not.
Torch's non-reentrant checkpoint, the first version, keeps the inputs in a Python closure
that only the dispatch mode can move; it still runs a call with no tensor input.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

logger = logging.getLogger(__name__)


class RecomputeRegions:
    """Module instances whose calls a step rebuilds in backward instead of keeping what they
    save. Held weakly: a module gone since the plan is simply not wrapped."""

    def __init__(self, modules: list[torch.nn.Module], call_bytes: list[int] | None = None) -> None:
        self._modules = [weakref.ref(m) for m in modules]
        # what each module's call does not keep, as the plan counted it on the trace
        self._call_bytes = call_bytes or [0] * len(modules)
        self.names = [type(m).__name__ for m in modules]
        self.step_bytes = 0  # of the running (or last) step: the calls it did rebuild
        # the step's rebuilt outputs: (module name, output index, whether its bytes differ)
        self.checks: list[tuple[str, int, torch.Tensor]] = []
        # id(module) -> the buffers its call wrote (BatchNorm's running statistics): a run
        # again in backward must leave them as forward did (``_StateKept``)
        self.written_buffers: dict[int, tuple[str, ...]] = {}
        # id(module) -> its buffers' names, looked up once (``named_buffers`` walks every
        # submodule: 6.5 us a call, three times a rebuilt call, on a host-bound step)
        self.buffer_names: dict[int, tuple[str, ...]] = {}
        self.graph_built = False  # a backward through a rebuilt call built a graph (create_graph=True)

    @contextmanager
    def applied(self, check: bool = True) -> Iterator[None]:
        """For one step: each module's calls checkpointed; the original ``forward`` back after
        (an instance attribute set by the user before is restored as it was)."""
        patched: list[tuple[torch.nn.Module, Any]] = []
        self.step_bytes = 0
        self.checks = []
        self.graph_built = False
        try:
            for ref, nbytes in zip(self._modules, self._call_bytes, strict=True):
                module = ref()
                if module is None or _is_wrapped(module.forward):
                    continue
                before = module.__dict__.get("forward", _ABSENT)
                rebuilt = functools.partial(self._rebuilt, nbytes)
                checks = self.checks if check else None
                module.forward = _checkpointed(module.forward, rebuilt, checks,  # type: ignore[method-assign]
                                               self)
                patched.append((module, before))
            yield
        finally:
            for module, before in reversed(patched):
                if before is _ABSENT:
                    del module.forward
                else:
                    module.forward = before  # type: ignore[method-assign]

    def _rebuilt(self, nbytes: int) -> None:
        self.step_bytes += nbytes

    def mismatch(self) -> RecomputeMismatchError | None:
        """The error for the step's first rebuilt output whose bytes differ from forward's,
        or None (one read of the device's flags per step)."""
        checks, self.checks = self.checks, []
        if not checks:
            return None
        at: dict[torch.device, list[int]] = {}
        for i, (_, _, flag) in enumerate(checks):
            at.setdefault(flag.device, []).append(i)
        differs = [False] * len(checks)
        with _disable_current_modes():  # the step's dispatch mode is still on: not one of its ops
            for where in at.values():  # one read per device
                for i, d in zip(where, torch.stack([checks[i][2] for i in where]).tolist(), strict=True):
                    differs[i] = d
        if not any(differs):
            return None
        owner, k, _ = checks[differs.index(True)]
        return RecomputeMismatchError(
            f"recompute: {owner} run again in backward gave another output {k} than in forward (its "
            f"forward depends on state it changes, or is not deterministic): its gradients would be "
            f"wrong; use OffloadConfig(recompute='off') for this model")


_ABSENT = object()


def _checkpointed(forward: Callable[..., Any], rebuilt: Callable[[], None],
                  checks: list[tuple[str, int, torch.Tensor]] | None, regions: RecomputeRegions
                  ) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved without grad: plain call
            return forward(*args, **kwargs)
        module = getattr(forward, "__self__", None)
        leaves, spec = tree_flatten((args, kwargs))
        stateful = next((x for x in leaves if not isinstance(x, _PLAIN)), None)
        if stateful is not None:  # running it again would change that object twice (a KV cache)
            _say_stateful(forward, stateful)
            return forward(*args, **kwargs)
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        params = [] if not isinstance(module, torch.nn.Module) else [
            p for p in module.parameters() if p.requires_grad]
        if not at:  # nothing to keep: torch's own checkpoint (its inputs are Python's)
            rebuilt()
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        call = _Call(_StateKept(forward, module, regions), leaves, spec, at, params, checks, regions)
        flat = _Rebuilt.apply(call, *[leaves[i] for i in at], *params)
        rebuilt()
        return call.output(flat)

    run.__hyperpar_recompute__ = True  # type: ignore[attr-defined]
    return run


class _StateKept:
    """A call's forward, and what its first run did to the module's buffers, so the run again
    in backward (``rerun``) leaves them as the first run left them (BatchNorm in training
    updates its running statistics at every call): it starts from the buffers as they were
    before the first run, where a previous step said which the call writes, and they are put
    back when its backward is done (its graph may have saved them: not before). Writes in
    place and buffers assigned anew alike (by name).
    """

    def __init__(self, forward: Callable[..., Any], module: Any, regions: RecomputeRegions) -> None:
        self.forward, self.module, self.mutated = forward, module, regions.written_buffers
        self.ran = False
        self.before: dict[str, torch.Tensor] = {}  # the written buffers' values before the first run
        self.written: tuple[str, ...] = ()
        names = regions.buffer_names
        if isinstance(module, torch.nn.Module) and id(module) not in names:
            names[id(module)] = tuple(n for n, _ in module.named_buffers())
        self.names = names.get(id(module), ())

    def _buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for n in self.names:
            try:
                out[n] = self.module.get_buffer(n)
            except AttributeError:  # deleted (or set to None) since: nothing to keep
                continue
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.ran:
            return self.forward(*args, **kwargs)
        self.ran = True
        buffers = self._buffers()
        if not buffers:
            return self.forward(*args, **kwargs)
        known = self.mutated.get(id(self.module), ())
        with torch.no_grad(), _disable_current_modes():
            self.before = {n: buffers[n].clone() for n in known if n in buffers}
        seen = {n: (b, b._version) for n, b in buffers.items()}
        out = self.forward(*args, **kwargs)
        after = self._buffers()
        written = {n for n, (b, v) in seen.items() if after.get(n) is not b or b._version != v}
        # a kernel may write a buffer without a version (BatchNorm's running statistics; its
        # counter has one): every buffer of a submodule that wrote one counts as written
        owners = {n.rpartition(".")[0] for n in written}
        self.written = tuple(n for n in seen if n in written or n.rpartition(".")[0] in owners)
        self.mutated[id(self.module)] = self.written
        return out

    @contextmanager
    def rerun(self) -> Iterator[None]:
        """Around the run again and its backward."""
        if not self.written:
            yield
            return
        buffers = self._buffers()
        left = {n: buffers[n] for n in self.written if n in buffers}  # as the first run left them
        with torch.no_grad(), _disable_current_modes():
            kept = {n: b.clone() for n, b in left.items()}
            for n, b in self.before.items():
                if n in left:
                    left[n].copy_(b)
        try:
            yield
        finally:
            with torch.no_grad(), _disable_current_modes():
                for n, b in left.items():
                    owner, _, leaf = n.rpartition(".")
                    holder = self.module.get_submodule(owner) if owner else self.module
                    setattr(holder, leaf, b)  # the object the first run left (if assigned anew since)
                    b.copy_(kept[n])


_PLAIN = (torch.Tensor, type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.memory_format, torch.layout, enum.Enum)
_said: set[tuple[str, str]] = set()


def _say_stateful(forward: Callable[..., Any], obj: object) -> None:
    owner = type(getattr(forward, "__self__", forward)).__name__
    key = (owner, type(obj).__name__)
    if key not in _said:
        _said.add(key)
        logger.warning("recompute: %s is called with a %s, which a second run in backward could change "
                       "again (a cache it updates, say): that call keeps what it saves instead", *key)


class RecomputeMismatchError(RuntimeError):
    """A call run again in backward gave other outputs than in forward: its gradients would
    be wrong, so backward stops here."""


class _Call:
    """One checkpointed call: how to run it again from its tensor inputs, and its output's
    structure (tensors go through ``_Rebuilt``, anything else is handed back as it was)."""

    def __init__(self, forward: Callable[..., Any], leaves: list[Any], spec: TreeSpec, at: list[int],
                 params: list[torch.Tensor], checks: list[tuple[str, int, torch.Tensor]] | None,
                 regions: RecomputeRegions) -> None:
        # the tensors come with each run (saved by autograd, not held here: a Python reference
        # would keep their bytes where the fast path must free them)
        held = list(leaves)
        for i in at:
            held[i] = None
        self.forward, self.leaves, self.spec, self.at = forward, held, spec, at
        self.params = params  # the module's, requiring grad: inputs of the call after its tensors
        self.checks = checks  # where backward leaves its comparisons (None: an unchecked step)
        self.regions = regions  # told when a backward through the call builds a graph
        self.out_leaves: list[Any] = []
        self.out_spec: TreeSpec | None = None
        self.out_at: list[int] = []

    def rerun(self) -> contextlib.AbstractContextManager[None]:
        """Around the run again in backward and its backward (``_StateKept.rerun``)."""
        return self.forward.rerun() if isinstance(self.forward, _StateKept) else contextlib.nullcontext()

    @property
    def owner(self) -> str:
        forward = self.forward.forward if isinstance(self.forward, _StateKept) else self.forward
        return type(getattr(forward, "__self__", forward)).__name__

    def call(self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> list[torch.Tensor]:
        leaves = list(self.leaves)
        for i, t in zip(self.at, tensors, strict=True):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        out_leaves, self.out_spec = tree_flatten(self.forward(*args, **kwargs))
        self.out_at = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        self.out_leaves = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
        return [out_leaves[i] for i in self.out_at]

    def output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_at, tensors, strict=True):
            leaves[i] = t
        assert self.out_spec is not None
        return tree_unflatten(leaves, self.out_spec)


class _Rebuilt(torch.autograd.Function):
    """A call run without keeping what it saves: its tensor inputs are saved through
    autograd's saved-tensor hooks (so a session's fast path can offload them, and a write
    to one since forward raises at backward, as for any saved tensor), and backward runs it
    again from them with the random-number and autocast state forward had. The module's
    parameters are inputs too, so their gradients flow as the call's own (``.backward()``
    and ``torch.autograd.grad`` alike)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        inputs = tensors[:len(tensors) - len(call.params)]
        ctx.call = call
        ctx.rng = _RngState(inputs)
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                        for d in {t.device.type for t in inputs}]
        with torch.no_grad():
            outs = call.call(inputs)
            ctx.sums = None if call.checks is None else _sums(outs)
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        call: _Call = ctx.call
        inputs = ctx.saved_tensors
        # a backward that builds a graph (``create_graph=True``: a gradient penalty) runs again
        # on the saved inputs themselves, so its gradients reach back through them too (equal
        # to plain PyTorch's to rounding: the session stops rebuilding after such a step)
        graph = torch.is_grad_enabled()
        if graph:
            call.regions.graph_built = True
        again = list(inputs) if graph else [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with call.rerun():
            return _Rebuilt._again(ctx, call, again, grads)

    @staticmethod
    def _again(ctx: Any, call: _Call, again: list[torch.Tensor], grads: tuple[torch.Tensor, ...]) -> Any:
        params = call.params
        with ctx.rng.restored(), torch.enable_grad(), contextlib.ExitStack() as stack:
            for device, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            outs = call.call(again)
        if call.checks is not None:
            owner = call.owner
            with torch.no_grad(), _disable_current_modes():  # on the device, read when the step ends
                for k, (o, before) in enumerate(zip(outs, ctx.sums, strict=True)):
                    call.checks.append((owner, k, torch.ne(_bytes_sum(o), before)))
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
        wrt = [x for x in again if x.requires_grad] + params
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True,
                                       create_graph=torch.is_grad_enabled())
                   if pairs and wrt else [None] * len(wrt))
        return (None, *[next(got) if x.requires_grad else None for x in again], *[next(got) for _ in params])


def _sums(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each output's byte sum, out of every dispatch mode's sight: a step traces the same ops
    whether it checks or not (a session's checked replay would see the check as a departure)."""
    with _disable_current_modes():
        return [_bytes_sum(o) for o in outs]


def _bytes_sum(t: torch.Tensor) -> torch.Tensor:
    """A sum of the tensor's bytes as integers of its element size (4 bytes at most): equal
    for equal bytes, a changed value changes it, whatever the layout (one reduction, no copy
    of a contiguous tensor, the same words for the same dtype at any offset)."""
    flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1)  # no grad here: no detach
    return flat.view(_WORDS.get(flat.element_size(), torch.int32)).sum(dtype=torch.int64)


_WORDS = {1: torch.uint8, 2: torch.int16}


class _RngState:
    """The random-number state a call saw, CPU and every device its inputs are on."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]) -> None:
        self.cpu = torch.get_rng_state()
        self.devices, self.states = get_device_states(*inputs)

    @contextmanager
    def restored(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.states)
            yield


def _is_wrapped(fn: Any) -> bool:
    return bool(getattr(fn, "__hyperpar_recompute__", False))
