"""``OffloadConfig(recompute="layers")`` (module calls rebuilt in backward, beside activation
offload) composes with what plain offload composes with: FSDP2, DDP and tensor parallelism on
two gloo ranks, compiled regions and ``skip_offload`` regions in one process. Every step is
bitwise the plain (no session) step; where rebuilding is documented not to happen (a step with
compiled or ``skip_offload`` regions: their module calls are not seen) the session says so
in ``_recompute_choice.why`` and still offloads. A rank that raises inside a rebuilt call's
backward ends its peer with an error within the timeout, never a hang."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadConfig, OffloadSession, skip_offload
from tests.rank_harness import run_ranks
from tests.reliability.recompute_rank_bodies import (
    MIB,
    rank_fails_in_rebuilt_backward,
    recompute_matches_plain,
    tensor_parallel_recompute_matches_plain,
)

STEPS = 6  # the choice is made on a checked replay (step 1, or 2 where step 1 diverges), then replayed
FRACTION = 0.5  # of the steady peak: below it, so the rest of the step is offloaded too
NO_REBUILD = "the step has compiled or skip_offload regions"


def _assert_rebuilt_and_bitwise(results: dict[int, dict[str, Any]], where: str) -> None:
    """Each rank: every step bitwise, the repeated blocks chosen, bytes rebuilt on every step
    from the first rebuilt one on, and that step replayed at least twice without divergence."""
    for rank, out in results.items():
        at = f"{where}, rank {rank}"
        assert all(out["equal"]), (at, out["equal"])
        assert out["why"] is not None and out["why"].startswith("full checkpointing"), (at, out["why"])
        names = out["names"]
        assert names is not None and len(names) >= 2 and all(n.endswith("Block") for n in names), (at, names)
        rebuilt = [r["bytes_recomputed"] > 0 for r in out["reports"]]
        assert True in rebuilt, (at, rebuilt)
        first = rebuilt.index(True)
        assert all(rebuilt[first:]) and first <= len(rebuilt) - 3, (at, rebuilt)
        for report in out["reports"][first + 1:]:
            assert report["phase"] == "replay" and report["diverged_at"] is None, (at, report)
        assert any(r["bytes_d2h"] > 0 for r in out["reports"][first:]), (at, "nothing offloaded beside")
    assert len({tuple(out["names"]) for out in results.values()}) == 1, "the ranks chose differently"


@pytest.mark.slow  # two forked ranks, plain and session runs: about 3 s on 2 busy cores
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_recompute_inside_fsdp2_and_ddp_is_bitwise_and_rebuilds(kind: str) -> None:
    """FSDP2 gathers a block's parameters in a pre-forward hook and reshards after; DDP reduces
    gradients from autograd hooks: a rebuilt block call in backward must see gathered
    parameters and hand its gradients to those hooks exactly as plain backward does."""
    results = run_ranks(recompute_matches_plain, 2, args=(kind, FRACTION, STEPS), timeout=45)
    _assert_rebuilt_and_bitwise(results, kind)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_recompute_with_tensor_parallel_blocks_is_bitwise_and_rebuilds() -> None:
    """Column-/row-wise linears (DTensor activations, an all-reduce inside every block): the
    rebuilt block runs its collective again in backward, on both ranks alike."""
    results = run_ranks(tensor_parallel_recompute_matches_plain, 2, args=(FRACTION, STEPS), timeout=45)
    _assert_rebuilt_and_bitwise(results, "tp")


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_a_rank_failing_in_a_rebuilt_backward_does_not_hang_its_peer(kind: str) -> None:
    """Rank 1's last block raises when backward rebuilds it (two rebuilt steps after the
    choice, so the failing step replays a rebuilt plan), while rank 0 goes on into the
    collectives of that backward: rank 1 gets its own error out of the session, rank 0 an
    error from the collective once rank 1 has left (or completes), both well within the
    timeout, each session holding nothing and every module's own ``forward`` back."""
    fail_step = STEPS - 1
    results = run_ranks(rank_fails_in_rebuilt_backward, 2, args=(kind, 1, fail_step), timeout=45)
    bad, peer = results[1], results[0]
    assert bad["error"] is not None and "injected failure in call 2" in bad["error"], bad
    assert bad["step"] == fail_step and bad["rebuilt"][-1] and bad["applied"], bad
    assert bad["calls"][-1] == 2 and bad["calls"][:-1] == [1] * (len(bad["calls"]) - 1), bad
    assert peer["step"] == fail_step, peer
    if peer["error"] is not None:  # the collective saw its peer leave
        assert "Connection" in peer["error"] or "closed" in peer["error"], peer
    for out in (bad, peer):
        assert out["seconds"] < 30 and out["tracked"] == 0 and out["forward_restored"], out


class Block(nn.Module):
    """A residual MLP block; with ``region`` its inner part is one ``skip_offload`` region."""

    def __init__(self, region: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.region = region

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (skip_offload(self.inner)(x) if self.region else self.inner(x))


def _net(how: str) -> nn.Module:
    """Four blocks and a head; ``compiled``: the second block compiled (aot_eager),
    ``skip_offload``: its inner part one opaque region, ``eager``: neither (the control)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [Block(region=how == "skip_offload" and i == 1) for i in range(4)]
    if how == "compiled":
        blocks[1] = torch.compile(blocks[1], backend="aot_eager")
    return nn.Sequential(*blocks, nn.Linear(32, 4))


@pytest.fixture
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons need run-to-run determinism
    torch._dynamo.reset()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("_one_thread")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("how", ["eager", "compiled", "skip_offload"])
def test_compiled_and_skip_offload_regions_are_bitwise_and_say_why_nothing_is_rebuilt(how: str) -> None:
    """A compiled block or a ``skip_offload`` region hides its module calls from the session:
    it documents that such a step is not rebuilt (``_recompute_choice.why``), and the steps stay
    bitwise plain's and offloaded. The eager control shows the same model is rebuilt otherwise."""
    plain, off = _net(how), _net(how)
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    with probe:
        _net(how)(torch.randn(64, 32)).square().mean().backward()
    assert probe.last_report is not None
    budget = int(FRACTION * probe.last_report.peak_resident_bytes)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, recompute="layers"))
    reports = []
    for step in range(STEPS):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        plain(x).square().mean().backward()
        with session:
            off(x).square().mean().backward()
        for a, b in zip(plain.parameters(), off.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (how, step)
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
        assert session.last_report is not None
        reports.append(session.last_report)
    choice = session._recompute_choice
    assert choice is not None
    rebuilt = [r.bytes_recomputed > 0 for r in reports]
    if how == "eager":
        assert session._recompute is not None and session._recompute.names == ["Block"] * 4, choice.why
        assert rebuilt[-3:] == [True] * 3, rebuilt
    else:
        assert choice.why == NO_REBUILD and not choice.regions and session._recompute is None, choice.why
        assert not any(rebuilt), rebuilt
    assert all(r.bytes_d2h > 0 for r in reports[:2]), "nothing offloaded below the peak"
    # no forward patched left behind (a compiled module holds its own ``forward`` attribute)
    own = [("forward" in m.__dict__) for m in plain.modules()]
    assert [("forward" in m.__dict__) for m in off.modules()] == own
