"""Run a function on N real gloo ranks (separate processes) with a hard timeout.

A hang fails the test instead of blocking CI, and no process outlives the call.
Usage::

    results = run_ranks(_body, world_size=2, args=(...,), timeout=60)

``_body(rank, world_size, *args)`` must be a module-level function (rank processes
import it). Its return value (picklable) is collected per rank; an exception on any
rank is re-raised here with that rank's traceback text.

Ranks are forked from a forkserver that has imported torch and hyperpar once (``PRELOAD``),
not spawned: a spawned rank spends 2-4 s of CPU importing them, which was most of a
multi-rank test's time on 2 cores. The server imports only, so every rank still starts
from a fresh state. ``HYPERPAR_TEST_RANKS_SPAWN=1`` goes back to spawn.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# What every rank imports anyway; the forkserver imports it once for all of them.
PRELOAD = ["torch", "torch.distributed", "hyperpar.multicore", "hyperpar.multicore.moe", "hyperpar.offload",
           "hyperpar.models"]
START_METHOD = "spawn" if os.environ.get("HYPERPAR_TEST_RANKS_SPAWN") == "1" else "forkserver"


def _context() -> Any:
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first use)
    return ctx


class RankFailure(AssertionError):
    """One or more ranks raised, hung, or died."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, store_path: str, fn: Callable[..., Any], args: tuple[Any, ...],
    init_pg: bool, queue: Any,
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    init_method=f"file://{store_path}")
        # By value: torch's queue would pass a tensor's storage as a file descriptor served by
        # this process, which can exit before the parent has taken it (connection reset).
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, True, result))
    except BaseException as exc:  # report everything, even SystemExit
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if init_pg and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    init_pg: bool = True,
    expect_failure: bool = False,
) -> dict[int, Any]:
    """Returns {rank: result}. With ``expect_failure`` returns {rank: error text} instead,
    and fails if any rank succeeded or hung."""
    ctx = _context()
    queue = ctx.Queue()
    # A file store needs no port: a free port picked here could be taken by a parallel run
    # before rank 0 binds it. gloo's own connections use kernel-assigned ports.
    store_dir = tempfile.mkdtemp(prefix="hyperpar-ranks-")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, init_pg, queue),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and r not in results and r not in errors]
                for r in dead:
                    # one more chance: its message may still be in flight
                    try:
                        rank, ok, payload = queue.get(timeout=1.0)
                        (results if ok else errors)[rank] = pickle.loads(payload) if ok else payload
                    except queue_mod.Empty:
                        errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                continue
            (results if ok else errors)[rank] = pickle.loads(payload) if ok else payload
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) + len(errors) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        queue.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    for r in missing:
        errors[r] = f"rank {r} did not finish within {timeout:.0f}s (hang)"
    if expect_failure:
        if results or missing:
            raise RankFailure(
                f"expected every rank to raise; succeeded: {sorted(results)}, hung: {missing}",
                errors,
            )
        return errors
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{text}", errors)
    return results
