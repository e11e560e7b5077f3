"""What autograd saves during a step, fingerprinted: recorded on a checked step, compared
on a fast one (``capture.fast.fast_replay``).

``pack`` sees every tensor autograd saves (the hooks are pushed for the whole step) and
keeps it as it is, with its version: autograd skips its own in-place check on tensors saved
through hooks, so ``unpack`` makes it. A fingerprint is the tensor's shape and dtype, which
earlier saved tensor of the step shares its storage (the aliasing), its storage offset and,
for a non-leaf that is no view of a leaf, its version counter (in-place writes; a leaf's
counter, which its views share, carries over between steps, as a parameter's optimizer
update does). Code that refuses to run under saved-tensor hooks (torch.func's transforms,
compiled regions) runs with the guard lifted (``guard_lifted``), and a step with such a
block is marked as not fully seen."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hyperpar.offload.capture.fast.fast_moves import MovingStep
from hyperpar.offload.capture.fast.fast_schedule import EventLog
from hyperpar.offload.capture.fast.saved_versions import checked_version
from hyperpar.offload.capture.mode import dispatch_mode
from hyperpar.offload.capture.mode.guard_stack import guard_lifted, running_guards

Tensor = torch.Tensor
Fingerprint = tuple[Any, ...]
# the first saved tensor's fingerprint -> another size's saved tensors and moves, or None
OtherSize = Callable[[Fingerprint], "tuple[tuple[Fingerprint, ...], MovingStep | None] | None"]
# a checked step's first saved tensor -> the fast step's guard that takes the step over, or None
HandOff = Callable[[Fingerprint], "SavedTensorGuard | None"]


class SavedTensorGuard:
    """``pack``/``unpack`` for ``torch.autograd.graph.saved_tensors_hooks``: records the
    fingerprints of a step's saved tensors (``expected=None``) or checks them."""

    __slots__ = ("__weakref__", "_expected", "_hand_off", "_next_slot", "_on_departure", "_other_size",
                 "_slots", "count", "departed_at", "fingerprints", "handed_to", "lifted", "log", "moving",
                 "saved_in_backward", "storages", "unpack", "why")

    def __init__(self, expected: tuple[Fingerprint, ...] | None = None,
                 on_departure: Callable[[int, str], None] | None = None, *,
                 log: EventLog | None = None, moving: MovingStep | None = None,
                 other_size: OtherSize | None = None, hand_off: HandOff | None = None) -> None:
        """``log``: record where each pack and unpack falls (a checked replay of a plan that
        moves bytes); ``moving``: run that plan's moves at those events (a fast step);
        ``other_size``: given the first saved tensor's fingerprint when it is not the plan's,
        the saved tensors and moves of the structure's plan for that size, if it has one (a
        step of another sequence length takes that plan's fast path: nothing has moved yet). A
        plan whose saved tensors *cover* the step's (``covers``: a shorter length) takes it
        too; past the first, a saved tensor the plan's covers is no departure either.
        ``hand_off`` (recording): given the first saved tensor's fingerprint, a fast step's
        guard that takes the rest of the step over (its plan covers the step's length), or
        None to go on recording; that guard packs the first saved tensor too."""
        self._expected = expected
        self._hand_off = hand_off
        self.handed_to: SavedTensorGuard | None = None
        self._on_departure = on_departure
        self._other_size = other_size
        self.log, self.moving = log, None
        self._follow(expected, moving)
        self.unpack: Callable[[Any], Tensor] = (self._fast_unpack if expected is not None
                                                else self._logged_unpack if log is not None or hand_off
                                                else _unpack)
        # storage address -> its slot (first seen order) and the storage, weakly: a storage
        # that died may leave its address to a new one, which is another slot
        self._slots: dict[int, tuple[int, weakref.ref]] = {}
        self._next_slot = 0
        self.count = 0
        self.fingerprints: list[Fingerprint] = []  # recorded (record mode)
        # the saved non-leaf tensors' storages, first seen first (a fallback's activations)
        self.storages: list[weakref.ref] = []
        self.departed_at: int | None = None
        self.why = ""
        self.lifted = False  # something disabled saved-tensor hooks (torch.func): not all were seen
        # a tensor was saved inside backward: a backward that builds a graph (create_graph=True)
        # or a checkpoint's run again (what the session's recompute must not stack on)
        self.saved_in_backward = False

    def __enter__(self) -> SavedTensorGuard:
        _install()
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        running_guards().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        # The moves' callback into the guard and ``unpack`` (bound to the guard, kept on it)
        # made reference cycles: each step's guard and all it held waited for the garbage
        # collector (233 objects a fast HF Llama step, 7,732 a tiny-ops one). Autograd keeps
        # its own reference to ``unpack``.
        if self.moving is not None:
            self.moving.on_held = None
        self.unpack = _unpack
        running_guards().remove(self)
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is not None and top[0] == self.pack:
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def fingerprint(self, t: Tensor) -> Fingerprint:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # storage-less layouts
            return (t.shape, t.dtype, -1, 0, 0)
        # a Python storage object lives as long as its storage (torch preserves it), so its
        # id names it while it lives; the weak reference tells a new one at a dead one's id
        known = self._slots.get(id(st))
        if known is not None and known[1]() is st:
            slot = known[0]
        elif self.moving is not None and (paged := self.moving.paged_slot(st)) is not None:
            slot = paged  # the fast path's copy of a slot paged back in: that slot
            self._slots[id(st)] = (slot, weakref.ref(st))
        else:
            ref = weakref.ref(st)
            base = t._base
            if not (t.is_leaf or (base is not None and base.is_leaf)):  # parameters and inputs are not
                self.storages.append(ref)  # the step's activations
            slot = self._next_slot
            self._next_slot = slot + 1
            self._slots[id(st)] = (slot, ref)
        # a leaf's version counter (and its views', which share it) carries over between
        # steps: a parameter's optimizer update
        if t.is_leaf:
            return (t.shape, t.dtype, slot, t.storage_offset(), 0)
        base = t._base
        return (t.shape, t.dtype, slot, t.storage_offset(),
                0 if base is not None and base.is_leaf else t._version)

    def pack(self, t: Tensor) -> tuple[Any, ...]:
        k = self.count
        self.count = k + 1
        fp = self.fingerprint(t)
        expected = self._expected
        if expected is None:  # recording (not the fast path): does backward save tensors?
            if k == 0 and self._hand_off is not None and (fast := self._hand_off(fp)) is not None:
                self.handed_to = fast  # (autograd unpacks this one tensor through this guard)
                return fast.pack(t)
            if not self.saved_in_backward and _in_backward() != -1:
                self.saved_in_backward = True
            self.fingerprints.append(fp)
            if self.log is not None:
                self.log.packed(fp[2], t, _storage(t))
                return t, t._version, fp[2]
        elif self.departed_at is None and (k >= len(expected) or expected[k] != fp):
            # the first: the best plan of the structure for it (``_resized``); later ones
            # must fit in the plan's (a shorter length, fewer tokens routed to an expert)
            fits = self._resized(fp) if k == 0 else k < len(expected) and covers(expected[k], fp)
            if not fits:
                self._depart(k, "more saved tensors than the plan's" if k >= len(expected)
                             else f"saved tensor {k} is {_describe(fp)}, the plan's {_describe(expected[k])}")
        if self.moving is not None:
            if self.departed_at is None:
                return self.moving.pack(t, fp[2], t._version, fp[0], fp[1], fp[3])
            return t, t._version, fp[2]
        return t, t._version

    def _resized(self, fp: Fingerprint) -> bool:
        """The first saved tensor is another size's: follow that size's plan, if there is one."""
        found = None if self._other_size is None else self._other_size(fp)
        if found is None:
            return False
        self._follow(*found)
        return True

    def _follow(self, expected: tuple[Fingerprint, ...] | None, moving: MovingStep | None) -> None:
        self._expected, self.moving = expected, moving
        if moving is not None:
            moving.on_held = self._held

    def _fast_unpack(self, packed: tuple[Any, ...]) -> Tensor:
        """A fast step's unpack: its moves' (a plan may be swapped for another size's at the
        first saved tensor, after autograd took this function for it)."""
        moving = self.moving
        return _unpack(packed) if moving is None else moving.unpack(packed)

    def _depart(self, k: int, why: str) -> None:
        self.departed_at, self.why = k, why
        if self.moving is not None:
            self.moving.on_plan = False  # what was copied out stays valid; nothing more moves
        if self._on_departure is not None:
            self._on_departure(k, why)

    def _held(self, why: str) -> None:
        """The moves found a released storage Python still holds (at saved tensor ``count``)."""
        if self.departed_at is None:
            self._depart(self.count - 1, why)

    def _logged_unpack(self, packed: tuple[Any, ...]) -> Tensor:
        if self.handed_to is not None:  # the first saved tensor, packed by the fast step's guard
            return self.handed_to._fast_unpack(packed)
        if self.log is not None:
            self.log.unpacked(packed[2])
        return _unpack(packed)

    def unversioned_alias(self, t: Tensor) -> None:
        """``t.data`` was taken during the step (``_data``)."""
        if self.moving is not None:
            self.moving.unversioned(t)

    def complete(self) -> bool:
        """After the step: whether it saved exactly the plan's tensors (and saw them all)."""
        return (self.departed_at is None and not self.lifted and self._expected is not None
                and self.count == len(self._expected))


_original_disable = torch.autograd.graph.disable_saved_tensors_hooks


_in_backward = torch._C._current_graph_task_id  # -1 outside a backward pass


@contextlib.contextmanager
def _disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
    """``torch.autograd.graph.disable_saved_tensors_hooks``, with the step's guard lifted."""
    with guard_lifted(), _original_disable(error_message):
        yield


def _install() -> None:
    """Once, at the first guarded step: the wrapper only acts while a guard is on this thread."""
    if torch.autograd.graph.disable_saved_tensors_hooks is _original_disable:
        torch.autograd.graph.disable_saved_tensors_hooks = _disable_saved_tensors_hooks


_tensor_data = torch._C.TensorBase.__dict__["data"]


def _data(self: Tensor) -> Tensor:
    """``Tensor.data`` while sessions live: an alias that shares the bytes but no version
    counter, so the fast path cannot see writes through it; it is told of it instead."""
    alias = _tensor_data.__get__(self)
    if running_guards():
        running_guards()[-1].unversioned_alias(self)
    return alias


def _set_data(self: Tensor, value: Tensor) -> None:
    _tensor_data.__set__(self, value)


def _install_data() -> None:
    torch.Tensor.data = property(_data, _set_data, doc=_tensor_data.__doc__)  # type: ignore[method-assign,assignment]


def _remove_data() -> None:
    if "data" in torch.Tensor.__dict__:
        del torch.Tensor.data


dispatch_mode.STEP_HOOKS.append((_install_data, _remove_data))


def _unpack(packed: tuple[Any, ...]) -> Tensor:
    """Autograd skips its own in-place check on tensors saved through hooks: made here, with
    autograd's words, so a step in a session fails where the plain step fails."""
    return checked_version(packed[0], packed[1])


def _storage(t: Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def covers(planned: Fingerprint, fp: Fingerprint) -> bool:
    """Whether a saved tensor ``fp`` fits in the plan's ``planned`` one: the same dtype, storage
    (the aliasing), version and rank, and no dimension or offset larger. A plan whose saved
    tensors cover a step's holds at least its bytes at every point, so its moves keep the
    budget; they stay correct whatever the sizes (a move takes the step's own storage, and
    unpack rebuilds each tensor with its own shape, strides and offset)."""
    shape, dtype, slot, offset, version = fp
    p_shape = planned[0]
    return (dtype == planned[1] and slot == planned[2] and version == planned[4] and offset <= planned[3]
            and len(shape) == len(p_shape) and all(a <= b for a, b in zip(shape, p_shape, strict=True)))


def covers_all(planned: tuple[Fingerprint, ...], fps: tuple[Fingerprint, ...] | list[Fingerprint]) -> bool:
    """Whether every saved tensor of a step fits in the plan's (``covers``), one for one."""
    return len(planned) == len(fps) and all(covers(p, f) for p, f in zip(planned, fps, strict=True))


def _describe(fp: Fingerprint) -> str:
    shape, dtype, slot, offset, version = fp
    return (f"{tuple(shape)}:{str(dtype).removeprefix('torch.')} (storage {slot}, offset {offset}, "
            f"version {version})")
