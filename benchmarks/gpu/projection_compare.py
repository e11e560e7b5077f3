"""Projected vs measured: the GPU run's host cost per op and step times next to the projection.

From the measured run: host µs per op of plain PyTorch (``no_offload``'s host time over the
ops of the step's trace), of the replay and of the warmup (each hyperpar variant's timed and
first step); then the projection of that variant's trace with those host costs and the link
bandwidth measured here, so prediction and measurement sit side by side in the JSON.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from typing import Any

from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.projection import HostCosts, get_device, project

log = logging.getLogger(__name__)


def device_model_for(gpu_name: str | None, bandwidth: dict[str, Any]) -> Any:
    """The table's model closest to this GPU (H100 unless it says H200 or A100), with the link
    measured here when it was."""
    name = (gpu_name or "").lower()
    model = get_device("h200" if "h200" in name else "a100" if "a100" in name else "h100")
    link = [bandwidth.get(k) for k in ("d2h_gbps", "h2d_gbps")]
    if all(isinstance(v, (int, float)) and v > 0 for v in link):
        model = replace(model, link_gbps=float(min(link)))
    return model


def compare(results: dict[str, dict[str, Any]], traces: dict[str, ActivationTrace],
            gpu_name: str | None, bandwidth: dict[str, Any]) -> dict[str, Any]:
    """Per hyperpar variant: measured host µs/op and step times, and the projection of its trace."""
    plain = results.get("no_offload", {})
    device = device_model_for(gpu_name, bandwidth)
    out: dict[str, Any] = {"device_model": asdict(device),
                           "note": "projection of the variant's own trace; compare on a GPU only"}
    for name, trace in traces.items():
        r = results.get(name, {})
        ops = trace.num_ops
        if not (r.get("ok") and plain.get("ok") and ops):
            continue
        host = HostCosts(plain_us=1e3 * plain["host_ms"] / ops, replay_us=1e3 * r["host_ms"] / ops,
                         warmup_us=1e3 * r["first_step_host_ms"] / ops)
        proj = project(trace, device, host, trace.memory_limit_bytes)
        out[name] = {
            "ops": ops, "kernels": proj.kernels, "host_us_per_op": asdict(host),
            "measured_ms": {"plain": plain["step_ms"], "replay": r["step_ms"]},
            "projected_ms": {"plain": proj.plain.step_us / 1e3, "replay": proj.replay.step_us / 1e3,
                             "warmup": proj.warmup.step_us / 1e3},
            "launch_bound_kernels": proj.plain.launch_bound_kernels,
        }
        log.info("%s: measured plain %.1f / replay %.1f ms, projected %.1f / %.1f ms", name,
                 plain["step_ms"], r["step_ms"], proj.plain.step_us / 1e3, proj.replay.step_us / 1e3)
    return out
