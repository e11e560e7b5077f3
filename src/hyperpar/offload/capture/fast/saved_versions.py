"""Autograd's in-place check for tensors saved through our hooks, which autograd skips.

Plain autograd keeps every saved tensor, and with it the tensor's version counter, until
backward reads it: a write through the tensor, a view of it or a ``.detach()`` alias
raises at unpack even when Python dropped all of them. The fast path keeps a moved saved
tensor only weakly (so its device bytes can be freed); a *version keeper* keeps the
counter without the bytes: a tensor that shares the saved tensor's version counter (as
``.detach()`` does) whose storage was swapped for an empty one. Writes through a ``.data``
alias share no counter, in plain PyTorch too: those are not errors, and the live bytes
must be the ones used (``capture.fast.fast_moves``)."""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor

_detach = torch._C.TensorBase.detach  # (not the session's wrapper of ``Tensor.detach``)
_set_data = torch._C.TensorBase.__dict__["data"].__set__  # (nor of ``Tensor.data``)


def version_keeper(t: Tensor, empty: Tensor) -> Tensor:
    """A storage-less tensor sharing ``t``'s version counter; ``empty``: a 0-element tensor on
    ``t``'s device. ``.detach()`` shares the counter and the bytes; setting its ``.data``
    swaps the storage and keeps the counter, moving no version (0.5 µs on this CPU)."""
    keeper = _detach(t)
    _set_data(keeper, empty)
    return keeper


def checked_version(t: Tensor, version: int, shape: Any = None) -> Tensor:
    """Autograd's in-place check, in its words (``shape``: the saved tensor's, where ``t`` is
    its version keeper)."""
    if t._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape if shape is None else shape)}] is at version "
            f"{t._version}; expected version {version} instead. Hint: enable anomaly detection to find "
            f"the operation that failed to compute its gradient, with "
            f"torch.autograd.set_detect_anomaly(True).")
    return t
