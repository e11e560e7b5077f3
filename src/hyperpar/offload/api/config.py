"""User-facing offload settings, checked when built so that a bad value fails early."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from hyperpar.offload.runtime.engine_factory import chaos_seed

PLANNER_CHOICES = ("greedy", "timed")
RECOMPUTE_CHOICES = ("auto", "off", "layers")
DIVERGENCE_CHOICES = ("retrace", "raise")
COPY_ENGINE_CHOICES = ("auto", "sync", "thread", "stream")
MIB = 1 << 20


def _check_mb(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"OffloadConfig.{name} must be a number of MiB, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"OffloadConfig.{name} must be finite and >= 0, got {value!r}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> the current accelerator (with its index) if there is one, else CPU."""
    if device is None:
        if torch.accelerator.is_available():
            acc = torch.accelerator.current_accelerator()
            assert acc is not None
            return torch.device(acc.type, torch.accelerator.current_device_index())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None and torch.accelerator.is_available():
        dev = torch.device(dev.type, torch.accelerator.current_device_index())
    return dev


@dataclass(frozen=True)
class OffloadConfig:
    max_resident_activation_mb: float = 1024
    max_offload_activation_mb: float = 65536
    planner: Any = "timed"  # "timed" (default) | "greedy" | an object with build(trace) -> schedule
    device: str | torch.device | None = None
    on_divergence: str = "retrace"
    verify: bool = False  # checksum every host copy at D2H, check it when the bytes come back
    # "auto" | "sync" | "thread" | "stream" | "chaos:SEED" (adversarial timing, rules checked:
    # a debug option) | an engine object (tests)
    copy_engine: Any = "auto"
    timeline: bool = False  # record replay op times for export_chrome_trace (costs ~2 us per op)
    # Budget as a fraction of the movable activation peak the first warmup measures (the peak
    # of bytes not kept past the step, without offload), plus the kept bytes (parameter
    # gradients, the loss, outputs) beside it; that first step runs under
    # max_resident_activation_mb. None: off.
    max_resident_fraction: float | None = None
    # A step whose plan moves nothing runs without the dispatch mode once a checked replay of
    # it ran clean (saved tensors fingerprinted instead; see capture/fast/fast_replay.py)
    fast_replay: bool = True
    # Rebuild module calls in backward instead of keeping what they save: "auto" where it
    # costs less than the copies an offload-only plan cannot hide, "layers" every repeated
    # block (full checkpointing per layer), "off" (default, for now: a rebuilding step is
    # traced again, and what its backward saves again stays on the device on the fast path) never
    recompute: str = "off"
    # Plan for another device than the one the session runs on: "h100", "h200", "a100" (the
    # models of ``hyperpar.offload.projection``), for the recompute choice and the offload
    # plan alike; None plans on the times measured here. The plan runs here unchanged.
    plan_for: str | None = None
    # A host budget for offloaded activations (MiB), and the directory whose file holds what
    # goes beyond it: copies the host cannot hold go on to disk and come back through host
    # (``runtime/disk_tier.py``). Both or neither; None: host copies are bounded only by
    # max_offload_activation_mb, past which storages stay on the device.
    max_host_activation_mb: float | None = None
    disk_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        _check_mb("max_resident_activation_mb", self.max_resident_activation_mb)
        _check_mb("max_offload_activation_mb", self.max_offload_activation_mb)
        if isinstance(self.planner, str):
            if self.planner not in PLANNER_CHOICES:
                raise ValueError(
                    f"OffloadConfig.planner must be one of {PLANNER_CHOICES} or an object with "
                    f"build(trace), got {self.planner!r}"
                )
        elif not callable(getattr(self.planner, "build", None)):
            raise TypeError(
                f"OffloadConfig.planner must be a planner name or an object with build(trace), "
                f"got {self.planner!r}"
            )
        if self.device is not None:
            if not isinstance(self.device, (str, torch.device)):
                raise TypeError(f"OffloadConfig.device must be None, a str or a torch.device, "
                                f"got {self.device!r}")
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(f"OffloadConfig.device is not a device: {self.device!r}") from exc
        if self.on_divergence not in DIVERGENCE_CHOICES:
            raise ValueError(
                f"OffloadConfig.on_divergence must be one of {DIVERGENCE_CHOICES}, "
                f"got {self.on_divergence!r}"
            )
        if not isinstance(self.verify, bool):
            raise TypeError(f"OffloadConfig.verify must be a bool, got {self.verify!r}")
        if isinstance(self.copy_engine, str):
            try:
                chaos = chaos_seed(self.copy_engine)
            except ValueError as exc:
                raise ValueError(f"OffloadConfig.copy_engine: {exc}") from None
            if self.copy_engine not in COPY_ENGINE_CHOICES and chaos is None:
                raise ValueError(f"OffloadConfig.copy_engine must be one of {COPY_ENGINE_CHOICES}, "
                                 f"'chaos:SEED' or an engine object, got {self.copy_engine!r}")
        elif not callable(getattr(self.copy_engine, "copy_d2h", None)):
            raise TypeError(f"OffloadConfig.copy_engine must be an engine name or an object with "
                            f"copy_d2h/copy_h2d, got {self.copy_engine!r}")
        if not isinstance(self.timeline, bool):
            raise TypeError(f"OffloadConfig.timeline must be a bool, got {self.timeline!r}")
        if not isinstance(self.fast_replay, bool):
            raise TypeError(f"OffloadConfig.fast_replay must be a bool, got {self.fast_replay!r}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"OffloadConfig.recompute must be one of {RECOMPUTE_CHOICES}, "
                             f"got {self.recompute!r}")
        if self.plan_for is not None:
            from hyperpar.offload.projection import DEVICES  # a table of device models, nothing more

            if not isinstance(self.plan_for, str) or self.plan_for.lower() not in DEVICES:
                raise ValueError(f"OffloadConfig.plan_for must be None or one of {sorted(DEVICES)}, "
                                 f"got {self.plan_for!r}")
        self._check_disk_tier()
        fraction = self.max_resident_fraction
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
                raise TypeError(f"OffloadConfig.max_resident_fraction must be None or a number in (0, 1], "
                                f"got {fraction!r}")
            if not 0 < fraction <= 1:  # NaN fails this too
                raise ValueError(f"OffloadConfig.max_resident_fraction must be in (0, 1], got {fraction!r}")

    def _check_disk_tier(self) -> None:
        host, disk = self.max_host_activation_mb, self.disk_dir
        if host is not None:
            _check_mb("max_host_activation_mb", host)
            if host == 0:
                raise ValueError("OffloadConfig.max_host_activation_mb must be > 0 (every copy passes "
                                 "through host on its way to disk), got 0")
        if disk is not None and not isinstance(disk, (str, os.PathLike)):
            raise TypeError(f"OffloadConfig.disk_dir must be None, a str or an os.PathLike, got {disk!r}")
        if (host is None) != (disk is None):
            given, missing = (("max_host_activation_mb", "disk_dir") if disk is None
                              else ("disk_dir", "max_host_activation_mb"))
            raise ValueError(f"OffloadConfig.{given}={host if disk is None else disk!r} needs "
                             f"OffloadConfig.{missing} too: a host budget sends what exceeds it to a "
                             f"directory's file, and the disk tier needs a host budget to start")

    @property
    def host_budget_bytes(self) -> int | None:
        """The host budget in bytes, or None without a disk tier."""
        host = self.max_host_activation_mb
        return None if host is None else max(1, int(host * MIB))

    @property
    def budget_bytes(self) -> int:
        return int(self.max_resident_activation_mb * MIB)

    def budget_for_peak(self, movable_peak_bytes: int, kept_bytes: int = 0) -> int:
        """The budget once the first step is measured: with a fraction, that share of the
        movable activation peak (bytes not kept past the step) plus the bytes the step keeps
        (parameter gradients, the loss, outputs: they stay whatever the plan), held for the
        whole step (``ActivationTrace.reserve_retained``) so the movable bytes alone keep the
        share at every op."""
        if self.max_resident_fraction is None:
            return self.budget_bytes
        return max(1, int(movable_peak_bytes * self.max_resident_fraction)) + kept_bytes

    @property
    def offload_cap_bytes(self) -> int:
        return int(self.max_offload_activation_mb * MIB)

    def resolved_device(self) -> torch.device:
        return resolve_device(self.device)

    def resolved_planner(self) -> Any:
        if not isinstance(self.planner, str):
            return self.planner
        from hyperpar.offload.planning import get_planner  # planning sits beside capture, not below api

        return get_planner(self.planner)
