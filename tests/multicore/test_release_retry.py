"""A runtime release that failed on one rank is retried only where it failed: the hooks that
succeeded are never run twice (a second release of a communicator is a double free), yet every
rank still takes part in the retry's collective, so none hangs."""

from __future__ import annotations

from typing import Any

import torch

from hyperpar.multicore import MANAGER, CollectiveError, register_runtime_release
from tests.multicore.fakes import ReleasingModule
from tests.rank_harness import run_ranks


def _body(rank: int, world: int) -> dict[str, Any]:
    ReleasingModule.fail_on = {1}  # the subclass hook fails on rank 1, once
    callback_calls: list[int] = []
    register_runtime_release(lambda: callback_calls.append(1))
    module = ReleasingModule(2)
    module(torch.ones(2))
    try:
        module.close()
        first = "no error"
    except CollectiveError as exc:
        first = str(exc)
    module.close()  # the retry
    return {"first": first, "hook_calls": ReleasingModule.releases, "callback_calls": len(callback_calls),
            "closed": module.execution_resources_closed, "bound": len(MANAGER.bound_groups()),
            "releases": MANAGER.runtime_releases}


def test_a_retry_reruns_only_the_hooks_that_failed_on_the_ranks_where_they_failed() -> None:
    results = run_ranks(_body, 2, timeout=60)
    assert results[0]["first"] == results[1]["first"]
    assert "rank 1: OSError: native runtime teardown failed" in results[0]["first"]
    assert results[0]["hook_calls"] == 1 and results[1]["hook_calls"] == 2, results
    for rank, out in results.items():
        assert out["callback_calls"] == 1, (rank, out)  # succeeded the first time on both ranks
        assert out["closed"] and out["bound"] == 0 and out["releases"] == 1, (rank, out)
