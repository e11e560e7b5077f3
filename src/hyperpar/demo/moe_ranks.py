"""The MoE run of the demo: the GPT with an MoE feed-forward, trained on N spawned ranks.

Experts are sharded over the ranks (expert parallel, ``MoeExperts``); everything else is
replicated and its gradients are summed across ranks, so every rank sees a different
batch and the replicas stay identical. The launcher owns the processes it starts: a hang
becomes an error after ``timeout_s`` and no process outlives :func:`run_moe_ranks`.
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyperpar.demo.results import RunResult
from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.models.moe_ffn import MoeFeedForward, moe_ffn_factory
from hyperpar.multicore.moe import MoeExperts

logger = logging.getLogger(__name__)
ERROR_GRACE_S = 10.0


class MoeRunError(RuntimeError):
    """A rank of the MoE run raised, died or hung; the message has every rank's story."""


@dataclass(frozen=True)
class MoeSettings:
    cfg: GPTConfig
    batch_size: int
    seed: int
    steps: int
    num_experts: int = 4
    top_k: int = 2
    lr: float = 1e-3
    backend: str = "gloo"  # "gloo" (CPU) or "nccl" (one GPU per rank)
    threads_per_rank: int = 1


def choose_backend(device: torch.device, world_size: int) -> tuple[str, str | None]:
    """(backend, note): NCCL with one GPU per rank when there are enough, else gloo on CPU."""
    if device.type == "cpu":
        return "gloo", None
    if device.type == "cuda" and torch.cuda.device_count() >= world_size:
        return "nccl", None
    return "gloo", (f"MoE run on CPU with gloo: {world_size} ranks need {world_size} {device.type} "
                    f"devices, this machine has {torch.accelerator.device_count()}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_moe_ranks(
    settings: MoeSettings, world_size: int = 2, timeout_s: float = 120.0,
    on_step: Callable[[int, float], None] | None = None,
) -> RunResult:
    """Train on ``world_size`` spawned ranks; rank 0's global loss per step is reported."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if settings.num_experts % world_size:
        raise ValueError(f"num_experts={settings.num_experts} must be divisible by world_size={world_size}")
    ctx = mp.get_context("spawn")
    messages: Any = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, settings, timeout_s, messages),
                         daemon=True, name=f"hyperpar-demo-moe-rank{rank}")
             for rank in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                kind, rank, payload = messages.get(timeout=0.5)
            except queue_module.Empty:
                for rank, p in enumerate(procs):
                    if not p.is_alive() and rank not in done and rank not in errors:
                        _drain_or_mark_dead(messages, rank, p.exitcode, done, errors, on_step)
                continue
            _record(kind, rank, payload, done, errors, on_step)
            if errors:  # the others may be stuck in a collective with it: a short grace, then kill
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(done) == world_size else 0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        messages.close()
    for rank in range(world_size):
        if rank not in done and rank not in errors:
            errors[rank] = f"did not finish within {timeout_s:.0f} s (hang?)"
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise MoeRunError(f"the MoE run failed on {len(errors)} of {world_size} ranks:\n{text}")
    first = done[0]
    result = RunResult(name=f"moe x{world_size}", losses=first["losses"], step_ms=first["step_ms"],
                       step_cpu_ms=first["step_cpu_ms"])
    result.notes.append(
        f"MoE: {settings.num_experts} experts, top-{settings.top_k}, {world_size} ranks over "
        f"{settings.backend}, workspace {first['workspace_bytes']} bytes shared by {settings.cfg.n_layer} "
        f"layers, replicas in sync: {'yes' if first['replicas_in_sync'] else 'NO'}")
    return result


def _record(kind: str, rank: int, payload: Any, done: dict[int, dict[str, Any]], errors: dict[int, str],
            on_step: Callable[[int, float], None] | None) -> None:
    if kind == "step":
        if on_step is not None:
            on_step(*payload)
    elif kind == "done":
        done[rank] = payload
    else:
        errors[rank] = payload


def _drain_or_mark_dead(messages: Any, rank: int, exitcode: int | None, done: dict[int, dict[str, Any]],
                        errors: dict[int, str], on_step: Callable[[int, float], None] | None) -> None:
    """A rank exited: its last messages may still be in the pipe."""
    try:
        while True:
            kind, r, payload = messages.get(timeout=1.0)
            _record(kind, r, payload, done, errors, on_step)
            if r == rank and kind != "step":
                return
    except queue_module.Empty:
        errors[rank] = f"died with exit code {exitcode}"


# --- inside each rank ---------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, port: int, settings: MoeSettings, timeout_s: float,
               messages: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        torch.set_num_threads(settings.threads_per_rank)
        if settings.backend == "nccl":
            torch.accelerator.set_device_index(rank)
        dist.init_process_group(settings.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        messages.put(("done", rank, _train(rank, world_size, settings, messages)))
    except BaseException as exc:  # every failure goes back to the launcher, even SystemExit
        messages.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.exception("rank %d: destroy_process_group failed", rank)


def _train(rank: int, world_size: int, s: MoeSettings, messages: Any) -> dict[str, Any]:
    device = torch.device("cuda", rank) if s.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(s.seed)  # the replicated part starts equal on every rank
    factory = moe_ffn_factory(num_experts=s.num_experts, top_k=s.top_k,
                              max_tokens=s.batch_size * s.cfg.seq_len, ep_size=world_size)
    model = GPT(s.cfg, ffn_factory=factory).to(device)
    experts = [m.experts for m in model.modules() if isinstance(m, MoeFeedForward)]
    torch.manual_seed(s.seed + 1000 + rank)  # each rank's experts are different experts
    for e in experts:
        e.reset_parameters()
    MoeExperts.share_execution_resources(experts)
    replicated = [p for name, p in model.named_parameters() if ".experts." not in name]
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr)
    gen = torch.Generator().manual_seed(s.seed + 1 + 7919 * rank)
    losses: list[float] = []
    step_ms: list[float] = []
    step_cpu_ms: list[float] = []
    try:
        for step in range(s.steps):
            x, y = random_batch(s.cfg, s.batch_size, gen, device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model.loss(x, y)
            (loss / world_size).backward()  # expert grads then match the averaged loss
            _sum_gradients(replicated)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            step_cpu_ms.append((time.process_time() - c0) * 1e3)
            losses.append(float(mean_loss.item()) / world_size)
            if rank == 0:
                messages.put(("step", rank, (step, losses[-1])))
        in_sync = _replicas_equal(replicated)
        workspace = experts[0].workspace_bytes
    finally:
        for e in experts:  # the same order on every rank, after the last backward
            e.close()
    return {"losses": losses, "step_ms": step_ms, "step_cpu_ms": step_cpu_ms, "replicas_in_sync": in_sync,
            "workspace_bytes": workspace}


def _sum_gradients(params: list[torch.nn.Parameter]) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _replicas_equal(params: list[torch.nn.Parameter]) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])
