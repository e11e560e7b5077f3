import time

import pytest
import torch
import torch.distributed as dist

from tests.rank_harness import RankFailure, run_ranks


def _sum_ranks(rank: int, world: int) -> int:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def _hang(rank: int, world: int) -> None:
    time.sleep(60)


def test_collects_results_from_every_rank() -> None:
    assert run_ranks(_sum_ranks, 2, timeout=60) == {0: 3, 1: 3}


def test_failure_names_rank_and_error() -> None:
    with pytest.raises(RankFailure, match="boom on rank 1") as info:
        run_ranks(_raise_on_one, 2, timeout=60, init_pg=False)
    assert set(info.value.errors) == {1}


def test_hang_fails_within_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match="hang"):
        run_ranks(_hang, 2, timeout=3, init_pg=False)
    assert time.monotonic() - start < 20
