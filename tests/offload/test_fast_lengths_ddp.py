"""Lengths that vary under DDP on two gloo ranks (each rank its own lengths): after a rank's
first fallback its steps start checked (DDP's collectives in forward run under the mode) and
hand off to the fast path at their first saved tensor: bitwise with plain DDP on every step."""

from __future__ import annotations

from hyperpar.offload.capture.checked.replay_state import SLACK_BYTES
from tests.offload.lengths_rank_bodies import ROWS, ddp_lengths_match_plain
from tests.rank_harness import run_ranks


def test_ddp_ranks_with_lengths_that_vary_hand_off_bitwise() -> None:
    results = run_ranks(ddp_lengths_match_plain, 2, (len(ROWS),), timeout=120)
    for rank, r in results.items():
        assert all(r["equal"]), (rank, r)
        paths = r["paths"]
        assert paths.count("fallback") == 1, (rank, paths)  # the first longer step, once
        after = paths[paths.index("fallback") + 1:]
        assert "fast" in after, (rank, paths)  # handed off at the first saved tensor
        assert all(p in ("fast", "checked") for p in after), (rank, paths)
        for path, peak in zip(paths, r["peak"], strict=True):  # a checked step larger than its plan:
            slack = SLACK_BYTES if path == "checked" else 0  # up to replay's slack over the budget
            assert peak <= max(1.05 * r["budget"], r["budget"] + slack), (rank, paths, r["peak"])
