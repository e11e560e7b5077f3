"""An extra row of ``hyperpar bench moe``: a stack of serial MoE layers, as in a model.

MoeExperts' layers share one workspace (the design's point: the kept bytes are paid once
per stack, not per layer); torchtitan's layers keep nothing between steps. Each layer adds
its output to the residual stream (``h = h + layer(h)``), every layer routes the same way,
and the step is timed and measured exactly as the single-layer rows (CPU time of a
fwd+bwd step, peak allocator rise in one step plus the bytes kept between steps).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hyperpar.bench.moe_peers import TorchtitanExperts, torchtitan_missing
from hyperpar.multicore.moe import MoeExperts

STACK_LAYERS = 4
STACK_DTYPE = "bfloat16"


class _Stack:
    def __init__(self, size: dict[str, int], dtype: torch.dtype, world: int, rank: int) -> None:
        torch.manual_seed(0)
        args = dict(local_num_tokens=size["tokens"], hidden_size=size["hidden"],
                    intermediate_size=size["inter"], num_experts=size["experts"], top_k=size["top_k"],
                    ep_size=world)
        self.ours = [MoeExperts(**args).to(dtype) for _ in range(STACK_LAYERS)]
        MoeExperts.share_execution_resources(self.ours)
        self.peer = None if torchtitan_missing() else [
            TorchtitanExperts(layer.gate_up_weight.detach(), layer.down_weight.detach(), size["experts"],
                              size["top_k"], world) for layer in self.ours]
        gen = torch.Generator().manual_seed(rank)
        self.x = torch.randn(size["tokens"], size["hidden"], generator=gen).to(dtype).requires_grad_()
        probs = torch.softmax(torch.randn(size["tokens"], size["experts"], generator=gen), -1)
        weights, self.ids = probs.topk(size["top_k"], -1)
        self.weights = weights.to(dtype).requires_grad_()
        self.names = ["MoeExperts"] + (["torchtitan"] if self.peer is not None else [])

    def _params(self) -> list[torch.Tensor]:
        params = [self.x, self.weights] + [p for layer in self.ours for p in layer.parameters()]
        return params + [p for layer in self.peer or [] for p in layer.parameters()]

    def step(self, name: str) -> None:
        for p in self._params():
            p.grad = None
        layers: list[Any] = self.ours if name == "MoeExperts" else self.peer or []
        h = self.x
        for layer in layers:
            h = h + layer(h, self.ids, self.weights)
        h.float().square().sum().backward()

    def kept_bytes(self, name: str) -> int:
        return self.ours[0].workspace_bytes if name == "MoeExperts" else 0

    def close(self) -> None:
        for layer in self.ours:
            layer.close()


def measure_stack(size: dict[str, int], dtype: torch.dtype, world: int, rank: int, steps: int,
                  peak_rise: Any) -> dict[str, Any]:
    """Per variant: step CPU ms (interleaved, rotating order), the peak rise of one step and
    the bytes kept between steps; ``peak_rise(fn)`` is the single-layer rows' measure."""
    stack = _Stack(size, dtype, world, rank)
    cpu: dict[str, list[float]] = {n: [] for n in stack.names}
    for i in range(steps + 1):  # the first round warms up
        turn = i % len(stack.names)
        for name in stack.names[turn:] + stack.names[:turn]:
            dist.barrier()
            start = time.process_time()
            stack.step(name)
            if i:
                cpu[name].append((time.process_time() - start) * 1e3)
    memory = {}
    for name in stack.names:
        for p in stack._params():
            p.grad = None
        dist.barrier()
        memory[name] = {"rise_bytes": peak_rise(lambda n=name: stack.step(n)),
                        "persistent_bytes": stack.kept_bytes(name)}
    stack.close()
    return {"cpu_ms": {n: statistics.median(v) for n, v in cpu.items()}, "memory": memory}


def summarise_stack(runs: list[dict[int, Any]], shape: str) -> dict[str, Any]:
    """Median over runs of the slowest rank's time and the larger rank's rise, plus kept bytes."""
    names = list(runs[0][0]["stack"][shape]["cpu_ms"])
    out: dict[str, Any] = {"layers": STACK_LAYERS, "dtype": STACK_DTYPE, "cpu_ms_slowest_rank": {},
                           "memory": {}}
    for n in names:
        out["cpu_ms_slowest_rank"][n] = statistics.median(
            max(run[r]["stack"][shape]["cpu_ms"][n] for r in run) for run in runs)
        rise = int(statistics.median(max(run[r]["stack"][shape]["memory"][n]["rise_bytes"] for r in run)
                                     for run in runs))
        kept = max(run[r]["stack"][shape]["memory"][n]["persistent_bytes"] for run in runs for r in run)
        out["memory"][n] = {"rise_bytes": rise, "persistent_bytes": kept, "total_bytes": rise + kept}
    if "torchtitan" in names:
        t = out["cpu_ms_slowest_rank"]
        out["moe_over_torchtitan"] = t["MoeExperts"] / t["torchtitan"]
    return out
