"""Route plan on one rank: stable expert order, splits, and the source-major -> expert-major index."""

from __future__ import annotations

import torch

from hyperpar.multicore.moe.routing import (
    RoutingSetup,
    _recv_to_expert,
    build_route_plan,
    inverse_permutation,
)


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
    setup = RoutingSetup(num_experts=4, top_k=2, max_tokens=8, ep_size=1, ep_rank=0, group=None, chunks=2,
                         capacity_rows=16, capacity_description="lossless")
    ids = torch.tensor([[3, 0], [0, 1], [3, 2], [1, 0], [2, 3]])
    plan = build_route_plan(setup, ids, 5)
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
