"""The lifecycle on 1, 2 and 3 real gloo ranks: every rank must agree, and none may hang."""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyperpar.multicore import MANAGER, CollectiveError, MoeExperts, close_groups, exchange
from tests.multicore.fakes import FakeModule, ReleasingModule
from tests.rank_harness import run_ranks

TIMEOUT = 60.0


def _lifecycle_body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    last = world - 1
    x = torch.ones(2)
    # the same binding order on every rank works; a shared group binds once
    a, b = FakeModule(4), FakeModule(8)
    FakeModule.share_execution_resources([a, b])
    a(x)
    b(x)
    c = FakeModule(2)
    c(x)
    out["ids"] = (a.binding_id, b.binding_id, c.binding_id)
    out["shared_specs"] = a.create_calls[0]["specs"]
    shared_res = a.created[0]
    # a module collected without close() leaves an orphan; the next compatible binding reuses it
    orphan_res = c.created[0]
    del c
    gc.collect()
    d = FakeModule(2)
    d(x)
    out["reused"] = d._resource_group.resources is orphan_res and not d.create_calls
    out["reused_id"] = d.binding_id
    # ... and an incompatible binding closes it
    del d
    gc.collect()
    e = FakeModule(32)
    e(x.double())
    out["orphan_closed"] = (orphan_res.close_calls, orphan_res.closed)
    # a close that fails on one rank raises on all, keeps ownership, and succeeds on retry
    f = FakeModule(7, close_failures=1 if rank == last else 0)
    f(x)
    try:
        f.close()
        out["close_error"] = None
    except CollectiveError as exc:
        out["close_error"] = str(exc)
    out["closing_after_failure"] = f._resource_group.closing and not f.execution_resources_closed
    f.close()
    out["retry_closed"] = (f.created[0].closed, f.execution_resources_closed, f.created[0].close_calls)
    # a shared member collected on rank 0 only (garbage-collection skew): close() must not hang
    g1, g2 = FakeModule(3), FakeModule(3)
    FakeModule.share_execution_resources([g1, g2])
    g1(x)
    skew_res = g1.created[0]
    keep = [g2] if rank != 0 else []
    del g2
    gc.collect()
    g1.close()
    out["skew_open_after_close"] = not skew_res.closed
    keep.clear()
    gc.collect()
    # destroy_process_group(subgroup) is torch's own and closes nothing; a close() after it runs
    # on this rank alone (its root is gone), and touches nothing else
    sub = dist.new_group(list(range(world)))
    h = FakeModule(9, root=sub)
    h(x)
    sub_res, e_res = h.created[0], e.created[0]
    dist.destroy_process_group(sub)
    out["sub_open_after_destroy"] = not sub_res.closed
    h.close()
    out["sub_closed"] = sub_res.closed and h.execution_resources_closed
    out["world_open_after_sub"] = not e_res.closed and not shared_res.closed
    # close_groups() without an argument closes everything left, orphans included, collectively
    close_groups()
    out["world_closed"] = (e_res.closed, shared_res.closed, skew_res.closed, a.execution_resources_closed)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lifecycle_on_real_ranks(world: int) -> None:
    results = run_ranks(_lifecycle_body, world, timeout=TIMEOUT)
    last = world - 1
    for out in results.values():
        assert out["ids"] == (1, 1, 2)
        assert out["shared_specs"] == (4, 8)
        assert out["reused"] and out["reused_id"] == 3
        assert out["orphan_closed"] == (1, True)
        assert out["close_error"] is not None
        assert f"close binding id 5' failed on 1 rank(s): rank {last}: OSError: fake close failure" \
            in out["close_error"]
        assert out["closing_after_failure"]
        assert out["retry_closed"] == (True, True, 2)  # close() is called again on every rank
        assert out["skew_open_after_close"] == (world > 1)
        assert out["sub_open_after_destroy"] and out["sub_closed"] and out["world_open_after_sub"]
        assert out["world_closed"] == (True, True, True, True)
    assert len({out["close_error"] for out in results.values()}) == 1  # the same error everywhere


def _catch(fn: Callable[[], Any]) -> tuple[str, bool, str]:
    try:
        fn()
    except Exception as exc:
        return (type(exc).__name__, isinstance(exc, TypeError), str(exc))
    return ("no error", False, "")


def _disagreement_body(rank: int, world: int) -> dict[str, Any]:
    last = world - 1
    x = torch.ones(1)
    out: dict[str, Any] = {}
    odd = FakeModule(5 if rank == last else 4)
    out["spec"] = _catch(lambda: odd(x))
    p, q = FakeModule(10), FakeModule(20)
    first = q if rank == last else p
    out["order"] = _catch(lambda: first(x))
    p(x)
    q(x)
    closer = q if rank == last else p
    out["close_order"] = _catch(closer.close)
    out["still_open"] = not p.execution_resources_closed and not q.execution_resources_closed
    p.close()
    q.close()
    untyped = FakeModule(1)
    out["type"] = _catch(lambda: untyped([1.0] if rank == last else x))
    closed = FakeModule(1)
    if rank == last:
        closed.close()
    out["closed"] = _catch(lambda: closed(x))
    failing = FakeModule(11, create_error=MemoryError("no room") if rank == last else None)
    out["create"] = _catch(lambda: failing(x))
    out["peers_freed"] = all(r.closed for r in failing.created) and failing.binding_id is None
    busy = FakeModule(12)
    busy(x)
    busy.created[0].busy = rank == last
    out["busy"] = _catch(busy.close)
    busy.created[0].busy = False
    busy.close()
    out["busy_closed_on_retry"] = busy.created[0].closed
    out["unpicklable"] = _catch(lambda: exchange((lambda: 0) if rank == last else 1))
    out["after"] = tuple(exchange(rank))  # every rank is still in step
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_disagreements_raise_the_same_error_on_every_rank(world: int) -> None:
    results = run_ranks(_disagreement_body, world, timeout=TIMEOUT)
    last = world - 1
    for key in ("spec", "order", "close_order", "type", "closed", "create", "busy", "unpicklable", "after"):
        assert len({out[key] for out in results.values()}) == 1, (key, results)
    out = results[0]
    assert out["spec"][2].startswith("stage 'bind': binding order or specifications differ across ranks: "
                                     "requested signature: rank 0 has")
    assert f"rank {last} has \"('tests.multicore.fakes.FakeModule', False, ('5', 'cpu', 'torch.float32'))" \
        in out["spec"][2]
    assert "binding order or specifications differ" in out["order"][2] and "'20'" in out["order"][2]
    assert "close order or groups differ across ranks" in out["close_order"][2]
    assert f"rank {last} has binding id 2" in out["close_order"][2] and out["still_open"]
    assert out["type"][1] and f"rank {last}: TypeError: FakeModule: x must be a torch.Tensor, got list" \
        in out["type"][2]
    assert f"rank {last}: RuntimeError: FakeModule: execution resources used after close()" \
        in out["closed"][2]
    assert f"rank {last}: MemoryError: no room" in out["create"][2]
    assert all(r["peers_freed"] for r in results.values())
    assert f"not ready to close on rank {last}" in out["busy"][2] and out["busy_closed_on_retry"]
    assert f"stage 'exchange' failed on 1 rank(s): rank {last}: " in out["unpicklable"][2]
    assert "a function value cannot be exchanged" in out["unpicklable"][2]
    assert out["after"] == tuple(range(world))


def _uncaught_mismatch_body(rank: int, world: int) -> None:
    FakeModule(4 + (rank == world - 1))(torch.ones(1))


def test_uncaught_disagreement_fails_every_rank_and_leaves_no_process() -> None:
    world = 3  # 2 ranks: covered by the caught disagreements above
    errors = run_ranks(_uncaught_mismatch_body, world, timeout=TIMEOUT, expect_failure=True)
    assert sorted(errors) == list(range(world))
    for text in errors.values():
        assert "binding order or specifications differ across ranks" in text
        assert f"rank {world - 1} has" in text
    assert multiprocessing.active_children() == []


def _seed_parity_body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = torch.ones(1)
    # active_specifications: every live member of the type and scope key, shared or not, bound or not
    p, q = FakeModule(3, scope="s"), FakeModule(5, scope="s")
    FakeModule.share_execution_resources([p, q])
    r = FakeModule(9, scope="s")
    FakeModule(100, scope="elsewhere")  # another scope: not counted (and collected at once)
    r(x)
    p(x)
    out["specs"] = (r.create_calls[0]["specs"], p.create_calls[0]["specs"])
    # sharing the same members again is a no-op, even after binding; other members still raise
    FakeModule.share_execution_resources([q, p])
    out["reshare"] = (p._resource_group is q._resource_group, p.binding_id, q.binding_id)
    out["reshare_other"] = _catch(lambda: FakeModule.share_execution_resources([p, r]))
    # lifecycle collectives run over the root group only: rank 2 stays out of the pair's steps
    pair = dist.new_group([0, 1])
    if rank < 2:
        pm = FakeModule(4, root=pair)
        pm(x)
        pm.close()
        out["pair"] = pm.execution_resources_closed
    else:  # outside the pair: new_group gave this rank GroupMember.NON_GROUP_MEMBER
        out["pair"] = _catch(lambda: MoeExperts(local_num_tokens=4, hidden_size=8, intermediate_size=4,
                                                num_experts=2, top_k=1, ep_size=2, ep_group=pair))
    # close_groups() with no argument closes every group: the world's, a subgroup's, this rank's own
    sub = dist.new_group(list(range(world)))
    in_sub, own = FakeModule(7, root=sub), FakeModule(11, local=True)
    in_sub(x)
    own(x)
    releases_before = MANAGER.runtime_releases
    close_groups()
    out["all_closed"] = (all(m.execution_resources_closed for m in (p, q, r, in_sub, own)),
                         MANAGER.bound_groups(), MANAGER.runtime_releases - releases_before)
    # the runtime release is an agreed stage with a subclass hook: failing on one rank it raises on
    # every rank, and a later close() retries it
    ReleasingModule.fail_on = {world - 1}
    m = ReleasingModule(2)
    m(x)
    out["release_error"] = _catch(m.close)
    out["release_state"] = (m.execution_resources_closed, ReleasingModule.releases)
    m.close()
    out["release_retry"] = (ReleasingModule.releases, MANAGER.runtime_releases - releases_before)
    m.close()  # nothing pending: a local no-op
    out["in_step"] = tuple(exchange(rank))
    return out


def test_seed_parity_on_three_ranks() -> None:
    results = run_ranks(_seed_parity_body, 3, timeout=TIMEOUT)
    for key in ("reshare_other", "release_error"):
        assert len({out[key] for out in results.values()}) == 1, (key, results)
    for rank, out in results.items():
        assert out["specs"] == ((3, 5, 9), (3, 5, 9)), rank
        assert out["reshare"] == (True, 2, 2), rank
        assert "modules[0] already ran (bound as binding id 2)" in out["reshare_other"][2]
        assert out["all_closed"] == (True, [], 1), rank  # one runtime release, after the last group
        assert out["release_state"] == (True, 1), rank
        assert out["release_retry"] == (2 if rank == 2 else 1, 2), rank  # rerun only where it failed
        assert out["in_step"] == (0, 1, 2)
    assert results[0]["pair"] is True and results[1]["pair"] is True
    assert results[2]["pair"][0] == "ValueError"
    assert "this rank (global rank 2) is not a member of ep_group" in results[2]["pair"][2]
    error = results[0]["release_error"]
    assert error[0] == "CollectiveError"
    assert ("stage 'multicore runtime release' failed on 1 rank(s): rank 2: OSError: native runtime "
            "teardown failed") in error[2]
