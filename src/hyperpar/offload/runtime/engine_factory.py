"""Choosing a copy engine by name (``auto``, ``sync``, ``thread``, ``stream``, ``chaos[:SEED]``).

Kept apart from ``copy_engine`` (the contract every engine imports) so the contract needs
none of the engines and the engines never import back through it.
"""

from __future__ import annotations

import os

import torch

from hyperpar.offload.runtime.chaos_copy_engine import ChaosCopyEngine
from hyperpar.offload.runtime.copy_engine import CopyEngine, SyncCopyEngine
from hyperpar.offload.runtime.stream_copy_engine import StreamCopyEngine
from hyperpar.offload.runtime.thread_copy_engine import ThreadCopyEngine

ENGINE_ENV = "HYPERPAR_COPY_ENGINE"  # replaces "auto": e.g. chaos:7 runs every such session under it


def chaos_seed(kind: str) -> int | None:
    """The seed of ``chaos`` / ``chaos:SEED`` (``chaos`` alone: 0); None for any other kind."""
    name, _, seed = kind.partition(":")
    if name != "chaos":
        return None
    if not seed:
        return 0
    if not seed.isdigit():
        raise ValueError(f"copy engine {kind!r}: the chaos seed must be an int >= 0, got {seed!r}")
    return int(seed)


def make_copy_engine(device: torch.device, kind: str = "auto") -> CopyEngine:
    """``auto``: copy streams on an accelerator, worker threads on CPU (or what the
    ``HYPERPAR_COPY_ENGINE`` environment variable names); or ``sync``/``thread``/``stream``/
    ``chaos[:SEED]``."""
    if kind == "auto":
        kind = os.environ.get(ENGINE_ENV) or "auto"
    if kind == "auto":  # (the variable may say so too)
        kind = "thread" if device.type == "cpu" else "stream"
    seed = chaos_seed(kind)
    if seed is not None:
        return ChaosCopyEngine(seed)
    if kind == "sync":
        return SyncCopyEngine()
    if kind == "thread":
        return ThreadCopyEngine()
    if kind == "stream":
        if device.type == "cpu":
            raise ValueError("copy engine 'stream' needs an accelerator device, got cpu")
        return StreamCopyEngine(device)
    raise ValueError(f"copy engine must be 'auto', 'sync', 'thread', 'stream' or 'chaos[:SEED]', "
                     f"got {kind!r}")
