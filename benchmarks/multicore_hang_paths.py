"""Time to error on every rank for each multicore hang path of issue 14.

Each scenario runs on 2 fresh gloo ranks (spawned processes, a file store, a short process-group
timeout so that a hang shows as "the timeout" instead of blocking for the 30 min default). Every
rank reports how long its step took and how it ended; a rank that has not reported within
``--limit`` seconds is killed and reported as hung. A rank that raised stays alive (waiting on
the store, not on the process group) until its peer has reported, as a program that logs the
error and goes on would, so the peer's figure is not cut short by the process exiting.

    .venv/bin/python benchmarks/multicore_hang_paths.py               # after: this checkout
    PYTHONPATH=/path/to/old/src .venv/bin/python benchmarks/multicore_hang_paths.py --label before

Results go to ``hyperpar-bench/multicore_hang_paths.json`` (one entry per ``--label``);
``--out benchmarks/results/multicore_hang_paths.json`` updates the committed one.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import queue as queue_module
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H, INTER, E, K, T = 16, 8, 4, 2, 8
RESULTS = Path("hyperpar-bench/multicore_hang_paths.json")  # benchmarks/results only when --out says so


def _layer(ep_size: int, **kwargs: Any) -> Any:
    from hyperpar.multicore import MoeExperts

    return MoeExperts(local_num_tokens=T, hidden_size=H, intermediate_size=INTER, num_experts=E, top_k=K,
                      ep_size=ep_size, **kwargs)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return torch.randn(T, H, generator=gen), ids, torch.rand(T, K, generator=gen)


def _timed(step: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        step()
        outcome = "ok"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:200]
    return {"seconds": round(time.monotonic() - start, 3), "outcome": outcome}


# ----- scenarios: (rank, world) -> this rank's report; "linger" keeps the process alive -----------
def expert_weights_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """`_weights` raised locally: expert_weights passed to a create_parameters=True layer on rank 0."""
    layer = _layer(world)
    x, ids, w = _inputs(rank)
    layer(x, ids, w)  # bound: the mistake comes on a later call
    extra = (layer.gate_up_weight, layer.down_weight) if rank == 0 else None
    return _timed(lambda: layer(x, ids, w, expert_weights=extra))


def bound_dtype_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """A float64 input to a layer bound to float32, on rank 0 only."""
    layer = _layer(world)
    x, ids, w = _inputs(rank)
    layer(x, ids, w)
    return _timed(lambda: layer(x.double() if rank == 0 else x, ids, w))


def destroy_in_finally(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 raises in user code and destroys the process group in `finally` while rank 1 is in
    an all_reduce; both have a bound layer. Rank 0 then exits (linger=False)."""
    layer = _layer(world)
    x, ids, w = _inputs(rank)
    layer(x, ids, w)
    dist.barrier()
    if rank == 1:
        report = _timed(lambda: dist.all_reduce(torch.ones(1)))
        return {**report, "linger": False}

    def fail_then_destroy() -> None:
        try:
            raise RuntimeError("user code failed")
        finally:
            dist.destroy_process_group()

    report = _timed(fail_then_destroy)
    return {**report, "linger": False, "layer_alive": layer is not None}


def ep1_forward_on_rank0_only(rank: int, world: int) -> dict[str, Any]:
    """The first forward of an ep_size=1 layer, on rank 0 only (rank 1 idles)."""
    layer = _layer(1)
    if rank != 0:
        return {"seconds": 0.0, "outcome": "idle"}
    x, ids, w = _inputs(rank)
    return _timed(lambda: layer(x, ids, w))


def _trained_ep1_layer(rank: int) -> tuple[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """An ep_size=1 layer that ran one step on every rank."""
    layer = _layer(1)
    inputs = _inputs(rank)
    layer(*inputs).sum().backward()
    dist.barrier()
    return layer, inputs


def ep1_close_on_rank0_only(rank: int, world: int) -> dict[str, Any]:
    """Both ranks run an ep_size=1 layer; rank 0 alone closes it."""
    layer, _ = _trained_ep1_layer(rank)
    return _timed(layer.close) if rank == 0 else {"seconds": 0.0, "outcome": "idle"}


def ep1_deepcopy_on_rank0_only(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 evaluates a deepcopy of a trained ep_size=1 layer (as in an evaluation loop)."""
    layer, (x, ids, w) = _trained_ep1_layer(rank)
    if rank != 0:
        return {"seconds": 0.0, "outcome": "idle"}

    def evaluate_copy() -> None:
        clone = copy.deepcopy(layer)
        with torch.no_grad():
            clone(x, ids, w)
        clone.close()
    return _timed(evaluate_copy)


def peer_dies_before_close(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's process dies just before the collective close; what does rank 0 raise, and when?"""
    layer = _layer(world)
    x, ids, w = _inputs(rank)
    layer(x, ids, w).sum().backward()
    dist.barrier()
    if rank == 1:
        os._exit(17)
    return _timed(layer.close)


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    f.__name__: f for f in (expert_weights_on_one_rank, bound_dtype_on_one_rank, destroy_in_finally,
                            ep1_forward_on_rank0_only, ep1_close_on_rank0_only, ep1_deepcopy_on_rank0_only,
                            peer_dies_before_close)
}


# ----- driver ------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, store_path: str, name: str, pg_timeout: float, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    try:
        report = SCENARIOS[name](rank, world)
    except Exception as exc:
        report = {"seconds": None, "outcome": f"setup failed: {type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    linger = report.pop("linger", True)
    out.put((rank, report))
    out.close()
    out.join_thread()  # flushed before os._exit below
    if linger:  # stay alive (on the store, not the process group) until every rank has reported
        store.add("reported", 1)
        deadline = time.monotonic() + 4 * pg_timeout + 30
        while store.add("reported", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # what happens at exit is measured elsewhere (tests/multicore/test_exit.py)


def run_scenario(name: str, pg_timeout: float, limit: float, world: int = 2) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="hang-paths-")
    procs = [ctx.Process(target=_rank_main, args=(r, world, os.path.join(store_dir, "store"), name,
                                                   pg_timeout, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, Any] = {}
    deadline = time.monotonic() + limit
    while len(reports) < world and time.monotonic() < deadline:
        try:
            rank, report = out.get(timeout=0.5)
            reports[rank] = report
        except queue_module.Empty:
            if all(not p.is_alive() for p in procs):
                break
    for r, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        if r not in reports:
            reports[r] = {"seconds": None, "outcome": f"no report (exit code {p.exitcode}; hung or died)"}
    return {f"rank {r}": reports[r] for r in sorted(reports)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--pg-timeout", type=float, default=5.0,
                        help="process-group timeout in seconds (the default of gloo is 30 min)")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds before a scenario is killed")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import hyperpar
    from hyperpar.bench.headlines import write
    from hyperpar.bench.result_file import provenance

    started = provenance()

    results: dict[str, Any] = {}
    for name in args.only or SCENARIOS:
        results[name] = run_scenario(name, args.pg_timeout, args.limit)
        print(name, json.dumps(results[name]), flush=True)
    entry = {
        "label": args.label, "hyperpar": str(Path(hyperpar.__file__).resolve().parent),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_average": os.getloadavg(),
        "pg_timeout_s": args.pg_timeout, "scenarios": results,
    }
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept = {k: v for k, v in existing.items() if k not in ("provenance", "headline")}
    write("multicore_hang_paths", args.out, {**kept, args.label: entry}, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
