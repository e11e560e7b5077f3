"""Bad values for every offload entry point: a clear error that names the argument and the value."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession, skip_offload

CONFIG_CASES: list[tuple[dict[str, Any], type[Exception], str]] = [
    (dict(max_resident_activation_mb="512"), TypeError,
     "OffloadConfig.max_resident_activation_mb must be a number of MiB, got '512'"),
    (dict(max_resident_activation_mb=True), TypeError,
     "OffloadConfig.max_resident_activation_mb must be a number of MiB, got True"),
    (dict(max_resident_activation_mb=None), TypeError,
     "OffloadConfig.max_resident_activation_mb must be a number of MiB, got None"),
    (dict(max_resident_activation_mb=-1), ValueError,
     "OffloadConfig.max_resident_activation_mb must be finite and >= 0, got -1"),
    (dict(max_resident_activation_mb=math.nan), ValueError,
     "OffloadConfig.max_resident_activation_mb must be finite and >= 0, got nan"),
    (dict(max_resident_activation_mb=math.inf), ValueError,
     "OffloadConfig.max_resident_activation_mb must be finite and >= 0, got inf"),
    (dict(max_offload_activation_mb=-0.5), ValueError,
     "OffloadConfig.max_offload_activation_mb must be finite and >= 0, got -0.5"),
    (dict(max_offload_activation_mb=[1]), TypeError,
     "OffloadConfig.max_offload_activation_mb must be a number of MiB, got [1]"),
    (dict(planner="fast"), ValueError, "OffloadConfig.planner must be one of ('greedy', 'timed')"),
    (dict(planner="fast"), ValueError, "got 'fast'"),
    (dict(planner=3), TypeError,
     "OffloadConfig.planner must be a planner name or an object with build(trace), got 3"),
    (dict(planner=object), TypeError, "OffloadConfig.planner must be a planner name"),
    (dict(device=0), TypeError, "OffloadConfig.device must be None, a str or a torch.device, got 0"),
    (dict(device="gpu0"), ValueError, "OffloadConfig.device is not a device: 'gpu0'"),
    (dict(on_divergence="ignore"), ValueError,
     "OffloadConfig.on_divergence must be one of ('retrace', 'raise'), got 'ignore'"),
    (dict(on_divergence=None), ValueError, "OffloadConfig.on_divergence must be one of"),
    (dict(verify=1), TypeError, "OffloadConfig.verify must be a bool, got 1"),
    (dict(verify="yes"), TypeError, "OffloadConfig.verify must be a bool, got 'yes'"),
    (dict(budget_mb=1), TypeError, "unexpected keyword argument 'budget_mb'"),
]


@pytest.mark.parametrize(("kwargs", "error", "text"), CONFIG_CASES, ids=lambda v: None)
def test_offload_config_rejects_bad_fields(kwargs: dict[str, Any], error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        OffloadConfig(**kwargs)
    assert text in str(info.value)


def test_an_accelerator_the_machine_lacks_is_named() -> None:
    present = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    missing = next(t for t in ("cuda", "xpu", "mps") if present is None or present.type != t)
    with pytest.raises(ValueError, match=f"OffloadConfig.device='{missing}'"):
        OffloadSession(OffloadConfig(device=missing))


@pytest.mark.parametrize("config", [{"max_resident_activation_mb": 1}, 512, "greedy"])
def test_session_names_its_argument(config: Any) -> None:
    with pytest.raises(TypeError, match=r"OffloadSession\(config=...\) needs an OffloadConfig, got "):
        OffloadSession(config)


@pytest.mark.parametrize("fn", [3, None, "f", torch.zeros(2)])
def test_skip_offload_needs_a_callable(fn: Any) -> None:
    with pytest.raises(TypeError, match=f"skip_offload needs a callable, got .* of type {type(fn).__name__}"):
        skip_offload(fn)


def test_a_rejected_config_leaves_no_active_session() -> None:
    with pytest.raises(ValueError):
        OffloadSession(OffloadConfig(planner="nope"))
    assert OffloadSession.get_active() is None
    with OffloadSession(OffloadConfig(max_resident_activation_mb=0)) as session:
        (torch.ones(3, requires_grad=True) * 2).sum().backward()
    assert session.phase == "replay"
