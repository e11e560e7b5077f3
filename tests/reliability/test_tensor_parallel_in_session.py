"""Tensor parallelism (``parallelize_module`` with column- and row-wise linears: the
activations between them are DTensors) inside an OffloadSession on two gloo ranks: losses
and local gradients bitwise equal to the same steps without a session, with another batch
size every step, activations moved, each step within the budget or its floor.

Regression: the session ran every op on a DTensor as one opaque op; the local tensors inside
were evicted under it and the ranks crashed with a segmentation fault in the first step."""

from __future__ import annotations

import pytest

from tests.rank_harness import run_ranks
from tests.reliability.tensor_parallel_bodies import MIB, tensor_parallel_matches_plain

BUDGET_MB = 0.2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_tensor_parallel_steps_match_plain() -> None:
    results = run_ranks(tensor_parallel_matches_plain, 2, args=(BUDGET_MB, 5), timeout=75)
    for rank, out in results.items():
        assert all(out["equal"]), (rank, out["equal"])
        phases = [r["phase"] for r in out["reports"]]
        assert phases.count("warmup") == 1, (rank, phases)
        for report in out["reports"]:
            assert report["bytes_d2h"] > 0, (rank, report)
            feasible = max(BUDGET_MB * MIB, report["min_feasible_budget_bytes"] or 0)
            assert report["peak_resident_bytes"] <= feasible + max(0.05 * feasible, 64 << 10), (rank, report)
