"""Tensors the runtime makes are normal tensors, also when a step runs in inference mode.

A tensor made under ``torch.inference_mode()`` is an inference tensor, and torch refuses an
in-place update of one outside inference mode. Inference mode is per thread: the copy
thread is never in it, and the step's own thread may have left it by the time a byte view
or a host slab made during an inference-mode op is copied into (an evaluation forward under
``inference_mode`` inside a session failed its first page-in: "Inplace update to inference
tensor outside InferenceMode is not allowed"). Views are not affected: a view of a normal
tensor stays normal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")
_inference = torch.is_inference_mode_enabled


def made_outside_inference_mode(make: Callable[P, T]) -> Callable[P, T]:
    """``make`` run with inference mode off where it is on (a check otherwise)."""
    @functools.wraps(make)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        if _inference():
            with torch.inference_mode(False):
                return make(*args, **kwargs)
        return make(*args, **kwargs)
    return wrapper
