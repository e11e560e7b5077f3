"""Issue 12's symptom end to end: a session trained with a new batch size and sequence length
every step must not grow its host pool once the shapes repeat (before the fix: held bytes
and allocations grew every step)."""

from __future__ import annotations

import random

import torch

from hyperpar.models import GPT, GPTConfig
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.runtime.host_pool import MIN_ARENA_BYTES


def test_held_bytes_and_allocations_flat_under_random_shapes() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=128, n_layer=1, n_head=2, d_model=64)
    model = GPT(cfg)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    shapes = [(rng.randint(1, 4), rng.randint(16, 128)) for _ in range(12)]
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.25, device="cpu"))
    # each shape first runs a few steps in a row (a warmup that offloads, then replays), so
    # that the first half sees every shape's need; then one random shape per step
    order = [shape for shape in shapes for _ in range(4)] + [rng.choice(shapes) for _ in range(52)]
    held, allocations, max_d2h = [], [], 0
    for batch, seq in order:
        idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        with session:
            model.loss(idx[:, :-1], idx[:, 1:]).backward()
        model.zero_grad(set_to_none=True)
        report = session.last_report
        assert report is not None
        max_d2h = max(max_d2h, report.bytes_d2h)
        held.append(session.held_bytes())
        allocations.append(session.host_allocations())
        # every slab in use was filled by a D2H copy of this step (plus alignment)
        assert held[-1] <= 2.5 * max(max_d2h, MIN_ARENA_BYTES), (held[-1], max_d2h)
    assert max_d2h > MIN_ARENA_BYTES  # the budget forced real offload
    assert allocations[50:] == [allocations[50]] * 50, allocations
    assert held[50:] == [held[50]] * 50, held
