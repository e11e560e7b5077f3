"""A bounded capacity that a call exceeds runs the overflow in extra waves, each within the
receive buffer, with the same results as the dense reference; lossless calls take one wave."""

from __future__ import annotations

import math

import torch

from hyperpar.multicore.moe.routing import wave_counts
from tests.multicore.moe.scenarios import compare_with_reference
from tests.multicore.moe.test_matches_reference import _check
from tests.rank_harness import run_ranks


def test_waves_fit_the_capacity_and_take_rows_in_receive_order() -> None:
    gen = torch.Generator().manual_seed(0)
    for sources, chunks, experts, capacity in [(2, 1, 4, 16), (3, 2, 2, 7), (4, 3, 1, 1), (2, 2, 3, 100)]:
        counts = torch.randint(0, 9, (sources, chunks, sources, experts), generator=gen)
        waves = wave_counts(counts, capacity)
        needed = int(counts.sum(dim=(0, 1, 3)).max())
        assert waves.shape[0] == max(1, math.ceil(needed / capacity))
        assert torch.equal(waves.sum(0), counts)  # every row in exactly one wave
        per_dest = waves.permute(0, 3, 2, 1, 4).reshape(waves.shape[0], sources, -1)  # (chunk, src, expert)
        assert int(per_dest.sum(2).max()) <= capacity  # no destination over capacity in any wave
        # each destination's rows in receive order: wave w holds positions [w * cap, (w + 1) * cap)
        for d in range(sources):
            labels = torch.repeat_interleave(torch.arange(per_dest.shape[2]), per_dest[:, d].sum(0))
            from_waves = torch.cat([torch.repeat_interleave(torch.arange(per_dest.shape[2]), per_dest[w, d])
                                    for w in range(waves.shape[0])])
            assert torch.equal(from_waves, labels)
            filled = per_dest[:, d].sum(1)  # full waves until this destination's rows run out
            starts = torch.arange(waves.shape[0]) * capacity
            assert torch.equal(filled, (int(labels.numel()) - starts).clamp(0, capacity))


def test_one_rank_bounded_capacity_is_one_wave() -> None:
    cases = [("full/skewed", 1, None, torch.float64, 1.0), ("full/uniform", 2, 0.4, torch.float32, 1.0)]
    report = compare_with_reference(0, 1, cases)
    _check(report, "world 1")
    assert all(diffs["waves"] == [1] for diffs in report.values())


def test_two_ranks_overflow_runs_in_waves() -> None:
    # 16 + 15 tokens x top-2 = 62 rows; capacity 32 rows (factor 1) or 42 (factor 1.3)
    cases = [("full/single_destination", 1, None, torch.float64, 1.0),  # all 62 rows to rank 1
             ("full/skewed", 2, 0.4, torch.float64, 1.0),  # 54 rows to rank 0, two chunks: ragged waves
             ("full/single_destination", 3, None, torch.float32, 1.3),
             ("uniform", 1, None, torch.float64, 1.0)]  # fits: one wave
    results = run_ranks(compare_with_reference, 2, args=(cases,), timeout=90)
    for rank, report in results.items():
        _check(report, f"world 2 rank {rank}")
        waves = [diffs["waves"] for diffs in report.values()]
        assert waves == [[2], [2], [2], [1]], f"rank {rank}: {waves}"
