"""Count the host<->device transfers of MoeExperts' forward and backward on a CPU-only machine.

There is no device here, so a ``TorchFunctionMode`` keeps the books: the tensors the
layer's ops receive stand for device tensors, and so does every tensor computed
from one, or created with an explicit ``device=``. Counted, on such a tensor:

- a *host read* (a device->host copy the host must wait for: a host sync on CUDA):
  ``item``, ``tolist``, ``numpy``, ``cpu``, ``int()``/``float()``/``bool()``/``index``,
  ``torch.equal``;
- a *copy in* (host->device): ``.to(<device>)`` of a host tensor, or ``torch.tensor`` /
  ``torch.as_tensor`` with a ``device=``. Only a ``non_blocking`` one from pinned memory
  spares the host a wait on CUDA (a blocking one synchronises the stream).

What it cannot see: work inside C++ kernels that synchronises by itself (CUDA's
``bincount`` reads its input's max on the host), so the layer must not call those on
device data (docs/moe.md says which it avoids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

import hyperpar.multicore.moe.function as moe_function

_READS = {"item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__", "equal"}
_FROM_HOST_DATA = {"tensor", "as_tensor"}


@dataclass
class Transfers:
    """What one forward moved between host and device."""

    reads: list[str] = field(default_factory=list)  # host reads of device data, by API name
    copies_in: list[bool] = field(default_factory=list)  # host->device copies: non_blocking?

    @property
    def blocking_copies_in(self) -> int:
        return sum(not non_blocking for non_blocking in self.copies_in)


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    return next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)


class TransferCounter(TorchFunctionMode):
    def __init__(self, device_tensors: tuple[Any, ...]) -> None:
        super().__init__()
        self.on_device = WeakTensorKeyDictionary()
        self.transfers = Transfers()
        self._mark(device_tensors)

    def _mark(self, value: Any) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self.on_device[leaf] = True

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        from_device = any(isinstance(t, torch.Tensor) and t in self.on_device
                          for t in tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        if name in _READS and from_device:
            self.transfers.reads.append(name)
            # on this CPU ``cpu()`` returns the tensor itself: hand back a host copy instead
            return out.clone() if name == "cpu" and isinstance(out, torch.Tensor) else out
        if name == "to" and _target_device(args, kwargs) is not None and not from_device:
            self.transfers.copies_in.append(bool(kwargs.get("non_blocking", False)))
            self._mark(out)
        elif name in _FROM_HOST_DATA and "device" in kwargs:
            self.transfers.copies_in.append(False)
            self._mark(out)
        elif from_device or "device" in kwargs:
            self._mark(out)
        return out


@contextmanager
def counting_transfers() -> Iterator[dict[str, list[Transfers]]]:
    """Every forward and backward op run inside records its ``Transfers`` under its direction."""
    seen: dict[str, list[Transfers]] = {"forward": [], "backward": []}
    real = {"forward": moe_function._forward, "backward": moe_function._backward}

    def counting(direction: str) -> Callable[..., Any]:
        def counted(call: Any, *tensors: Any) -> Any:
            counter = TransferCounter(tensors)
            with counter:
                result = real[direction](call, *tensors)
            seen[direction].append(counter.transfers)
            return result
        return counted

    moe_function._forward = counting("forward")  # type: ignore[assignment]
    moe_function._backward = counting("backward")  # type: ignore[assignment]
    try:
        yield seen
    finally:
        moe_function._forward = real["forward"]  # type: ignore[assignment]
        moe_function._backward = real["backward"]  # type: ignore[assignment]
