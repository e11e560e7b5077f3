"""Route plan on one rank: stable expert order, splits, and the source-major -> expert-major index."""

from __future__ import annotations

import pytest
import torch

from hyperpar.multicore.moe.routing import (
    RoutingSetup,
    _chunk_of_rows,
    _recv_to_expert,
    build_route_plan,
    inverse_permutation,
)


def _setup(chunks: int = 1) -> RoutingSetup:
    return RoutingSetup(num_experts=4, top_k=2, max_tokens=8, ep_size=1, ep_rank=0, group=None, chunks=chunks,
                        capacity_rows=16, capacity_description="lossless")


def test_chunk_of_rows_follows_the_chunk_bounds() -> None:
    for tokens in range(0, 13):
        for chunks in range(1, 6):
            bounds = [tokens * c // chunks for c in range(chunks + 1)]  # chunk c: [bounds[c], bounds[c+1])
            want = [c for c in range(chunks) for _ in range((bounds[c + 1] - bounds[c]) * 3)]
            assert _chunk_of_rows(tokens, 3, chunks, torch.device("cpu")).tolist() == want, (tokens, chunks)


@pytest.mark.parametrize(("low", "high"), [(-3, 3), (0, 9), (-(2**40), 2**40)])
def test_ids_out_of_range_are_rejected_with_their_range(low: int, high: int) -> None:
    ids = torch.tensor([[1, high], [low, 0], [2, 0]])
    with pytest.raises(ValueError, match=rf"topk_ids must lie in \[0, 4\), got values in \[{low}, {high}\]"):
        build_route_plan(_setup(chunks=2), ids, 3)


def test_wrong_tokens_per_expert_is_rejected_with_both_counts() -> None:
    ids = torch.tensor([[1, 0], [0, 3], [2, 3]])
    with pytest.raises(ValueError, match=r"tokens_per_expert=\[2, 1, 1, 1\] does not match the counts of "
                       r"topk_ids \[2, 1, 1, 2\]"):
        build_route_plan(_setup(), ids, 3, tokens_per_expert=torch.tensor([2, 1, 1, 1]))
    assert build_route_plan(_setup(), ids, 3, tokens_per_expert=torch.tensor([2, 1, 1, 2])).recv_rows == 6


def test_recv_to_expert_reorders_source_major_rows() -> None:
    per_source = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source][local expert]
    # received rows, source-major, labelled (source, expert, i)
    labels = [(s, e, i) for s in range(2) for e in range(3) for i in range(int(per_source[s, e]))]
    index = _recv_to_expert(per_source)
    reordered = [labels[int(j)] for j in index]
    assert reordered == sorted(labels, key=lambda t: (t[1], t[0], t[2]))


def test_inverse_permutation_undoes_the_gather() -> None:
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    rows = torch.randn(50, 3)
    inverse = inverse_permutation(perm)
    assert torch.equal(rows[perm][inverse], rows)
    assert torch.equal(torch.empty_like(rows).index_copy_(0, perm, rows), rows[inverse])


def test_single_rank_plan_is_a_stable_sort_by_expert() -> None:
    ids = torch.tensor([[3, 0], [0, 1], [3, 2], [1, 0], [2, 3]])
    plan = build_route_plan(_setup(chunks=2), ids, 5)
    flat = ids.flatten()
    assert len(plan.chunks) == 2 and plan.recv_rows == 10
    first, second = plan.chunks  # tokens [0, 2) and [2, 5)
    assert first.order.tolist() == [1, 2, 3, 0] and first.expert_counts == [2, 1, 0, 1]
    assert second.send_begin == 4 and second.expert_counts == [1, 1, 2, 2]
    for route in plan.chunks:
        chosen = flat[route.order]
        assert torch.equal(chosen, chosen.sort(stable=True).values)
        assert torch.equal(route.source_token, route.order // 2)
        assert route.expert_offsets.tolist() == torch.tensor(route.expert_counts).cumsum(0).tolist()
    # every piece's sorted rows, in piece order, un-permute to (token, k) order
    assert plan.unsort is not None
    assert torch.equal(torch.cat([r.order for r in plan.chunks])[plan.unsort], torch.arange(10))
