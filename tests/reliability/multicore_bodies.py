"""Rank bodies for multicore fault injection (module-level: spawned ranks import them).

Each body injects a fault on one rank, catches what every rank sees, then shows that a
retry after a recoverable failure works and that all ranks are still in step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hyperpar.multicore import MANAGER, CollectiveError, exchange, register_runtime_release
from tests.multicore.fakes import FakeModule

SHORT_TIMEOUT_S = 2.0


class SignatureFaultModule(FakeModule):
    """Fails while computing its binding signature (before any collective), when told to."""

    def __init__(self, size: int, signature_error: Exception | None = None, **kwargs: Any) -> None:
        super().__init__(size, **kwargs)
        self.signature_error = signature_error

    def _resource_signature(self, tensor: torch.Tensor) -> Any:
        if self.signature_error is not None:
            raise self.signature_error
        return super()._resource_signature(tensor)


def _catch(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def recoverable_faults_body(rank: int, world: int, bad: int) -> dict[str, Any]:
    """Rank ``bad`` fails at binding (creation, signature), at closing, at the runtime release,
    and binds in another order; every rank must see the same error, and each retry succeeds."""
    x = torch.ones(2)
    out: dict[str, Any] = {}
    mine = rank == bad

    # 1. creating the resources fails on one rank; the peers free what they created
    m = FakeModule(4, create_error=OSError("cannot allocate workspace") if mine else None)
    out["create"] = _catch(lambda: m(x))
    out["create_peers_freed"] = all(r.closed for r in m.created) and m.binding_id is None
    m.create_error = None
    out["create_retry"] = (m(x).tolist(), m.binding_id)
    m.close()
    out["create_retry_closed"] = m.created[-1].closed

    # 2. the signature hook (local, before the manifest exchange) raises on one rank
    s = SignatureFaultModule(6, signature_error=KeyError("no such dtype") if mine else None)
    out["signature"] = _catch(lambda: s(x))
    s.signature_error = None
    out["signature_retry"] = s(x).tolist()
    s.close()

    # 3. a close fails on one rank: every rank raises, ownership stays, a retry closes
    c = FakeModule(7, close_failures=1 if mine else 0)
    c(x)
    out["close"] = _catch(c.close)
    out["close_kept"] = not c.execution_resources_closed and c._resource_group.closing
    c.close()
    out["close_retry"] = (c.execution_resources_closed, c.created[0].closed)

    # 4. the runtime release callback raises once on one rank: every rank raises, a retry releases
    calls: list[int] = []
    fail_once = [mine]

    def release() -> None:
        calls.append(1)
        if fail_once.pop() if fail_once else False:
            raise RuntimeError("runtime teardown failed")

    register_runtime_release(release)
    r1 = FakeModule(2)
    r1(x)
    out["release"] = _catch(r1.close)
    r1.close()
    r2 = FakeModule(2)
    r2(x)
    r2.close()
    out["release_calls"] = (len(calls), MANAGER.runtime_releases >= 2, MANAGER.bound_groups() == [])

    # 5. one rank binds in another order; then every rank binds in the agreed order
    p, q = FakeModule(10), FakeModule(20)
    out["order"] = _catch(lambda: (q if mine else p)(x))
    out["order_retry"] = (p(x).tolist(), q(x).tolist(), p.binding_id, q.binding_id)
    p.close()
    q.close()
    out["in_step"] = exchange(rank)
    return out


def _timed(fn: Callable[[], Any]) -> None:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        elapsed = time.monotonic() - start
        cause = type(exc.__cause__).__name__
        raise RuntimeError(f"raised after {elapsed:.1f}s (cause {cause}): {type(exc).__name__}: {exc}") \
            from exc
    raise AssertionError("a peer left, yet this rank's collective step succeeded")


def early_exit_body(rank: int, world: int, leaver: int, how: str, stage: str) -> None:
    """Rank ``leaver`` leaves (``how``: "exit" kills its process, "silent" stays alive but never
    joins) just before the other ranks bind or close over a group with a short timeout. The
    others must raise within about that timeout; the leaver fails too, so no rank succeeds."""
    sub = dist.new_group(list(range(world)), timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    m = FakeModule(4, root=sub)
    x = torch.ones(2)
    if stage == "close":
        m(x)
    dist.barrier(group=sub)  # everyone is past the group's setup: the leaver leaves the next step only
    if rank == leaver:
        if how == "exit":
            os._exit(17)
        time.sleep(2.5 * SHORT_TIMEOUT_S)
        raise RuntimeError("this rank stayed away on purpose")
    _timed((lambda: m(x)) if stage == "bind" else m.close)
