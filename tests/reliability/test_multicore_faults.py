"""Multicore fault injection on real gloo ranks: the same error on every rank, no hang, no process
left behind, and a retry after a recoverable failure succeeds."""

from __future__ import annotations

import multiprocessing
import re

import pytest

from tests.rank_harness import run_ranks
from tests.reliability.multicore_bodies import SHORT_TIMEOUT_S, early_exit_body, recoverable_faults_body

TIMEOUT = 60.0


@pytest.mark.parametrize(("world", "bad"), [(3, 0)])  # the last rank failing: tests/multicore
def test_recoverable_faults_raise_everywhere_and_retries_succeed(world: int, bad: int) -> None:
    results = run_ranks(recoverable_faults_body, world, args=(bad,), timeout=TIMEOUT)
    for key in ("create", "signature", "close", "release", "order"):
        assert len({out[key] for out in results.values()}) == 1, (key, results)  # same text everywhere
    out = results[0]
    assert f"stage 'create resources' failed on 1 rank(s): rank {bad}: OSError: cannot allocate workspace" \
        in out["create"]
    assert f"stage 'bind' failed on 1 rank(s): rank {bad}: KeyError: 'no such dtype'" in out["signature"]
    assert re.search(rf"close binding id \d+' failed on 1 rank\(s\): rank {bad}: OSError: fake close failure",
                     out["close"])
    assert (f"stage 'multicore runtime release' failed on 1 rank(s): rank {bad}: RuntimeError: runtime "
            "teardown failed") in out["release"]
    assert "binding order or specifications differ across ranks" in out["order"]
    for rank, out in results.items():
        assert out["create_peers_freed"], rank
        assert out["create_retry"] == ([12.0, 12.0], 1) and out["create_retry_closed"], rank
        assert out["signature_retry"] == [18.0, 18.0], rank
        assert out["close_kept"] and out["close_retry"] == (True, True), rank
        # failed, retried by close() where it failed only, again after r2
        assert out["release_calls"] == (3 if rank == bad else 2, True, True), rank
        ids = out["order_retry"][2:]
        assert ids[1] == ids[0] + 1, rank
        assert out["in_step"] == list(range(world)), rank
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(("world", "how", "stage"), [(2, "exit", "bind"), (3, "silent", "close")])
def test_a_rank_that_leaves_makes_the_others_raise_within_the_timeout(world: int, how: str,
                                                                      stage: str) -> None:
    leaver = world - 1
    errors = run_ranks(early_exit_body, world, args=(leaver, how, stage), timeout=TIMEOUT,
                       expect_failure=True)
    assert sorted(errors) == list(range(world))
    if how == "exit":
        assert "died with exit code 17" in errors[leaver]
    for rank in range(world):
        if rank == leaver:
            continue
        found = re.search(r"raised after ([\d.]+)s \(cause (\w+)\): (\w+): (.*)", errors[rank])
        assert found, errors[rank]
        assert float(found.group(1)) <= SHORT_TIMEOUT_S + 10, errors[rank]
        # the error names the lifecycle stage; the backend's own error is chained and quoted (the
        # peer's connection closed, or the short timeout expired)
        assert found.group(3) == "CollectiveError" and found.group(4).startswith(f"stage '{stage}'")
        assert found.group(2) in ("DistBackendError", "DistNetworkError", "RuntimeError"), errors[rank]
        assert re.search(r"timed out|connection (closed|reset)", found.group(4), re.IGNORECASE), errors[rank]
    assert multiprocessing.active_children() == []
