"""torch.compile inside a session runs compiled, bitwise equal to the same compiled model
without a session, and the activations around (and saved by) compiled regions are offloaded.

Each backend is wrapped to count the compiled graph's runs, so "it ran compiled" is a fact
the test checks, not an assumption.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hyperpar.offload import OffloadCompileError, OffloadConfig, OffloadSession, skip_offload
from hyperpar.offload.ir import ResidencyActionType
from tests.offload.equality_harness import Case, run_equality

# torch's own compile path imports TorchScript pieces that warn about their deprecation
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons need run-to-run determinism
    torch._dynamo.reset()  # each test compiles Block.forward afresh: no recompile limit across tests
    yield
    torch.set_num_threads(threads)


def counting(backend: str, runs: list[int]) -> Callable[..., Any]:
    """``backend``, with every run of a compiled graph appended to ``runs``."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        compiled = inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            runs.append(1)
            return compiled(*args)

        return run

    return compile_graph


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _compiled_model(backend: Any) -> nn.Module:
    return nn.Sequential(*[torch.compile(Block(), backend=backend) for _ in range(3)], nn.Linear(32, 4))


def _x(step: int) -> tuple[torch.Tensor]:
    return (torch.randn(64, 32, generator=torch.Generator().manual_seed(step)).tanh(),)


# inductor compiles C++ kernels: about 20 s on 2 busy cores with a cold cache, 2 s warm
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_blocks_run_compiled_and_match_compiled_plain_at_every_budget(backend: str) -> None:
    runs: list[int] = []
    case = Case(f"compiled blocks ({backend})", lambda: _compiled_model(counting(backend, runs)), _x,
                loss=lambda m, args: m(torch.tanh(args[0])).square().sum())
    reports = run_equality(case, fractions=(1.0, 0.5, 0.0), replays=2)
    # measure + 3 budgets x 3 steps x (plain + session): 3 compiled forwards each
    assert len(runs) == 3 * (1 + 3 * 3 * 2), "a compiled block ran eagerly"
    for frac, steps in reports.items():
        assert all(r.diverged_at is None for r in steps), frac
    assert all(r.bytes_d2h > 0 for r in reports[0.5]), "nothing was offloaded at half the peak"


class CheckpointedCompiled(nn.Module):
    """Compiled blocks under non-reentrant checkpointing: the recomputation in backward is a
    compiled region too, and the checkpoint's own saved-tensor hooks keep the saves."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([torch.compile(Block(), backend=backend) for _ in range(2)])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head.weight.sum() + torch.tanh(x)  # requires grad: the checkpoint recomputes
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def test_checkpointed_compiled_blocks_match_plain() -> None:
    runs: list[int] = []
    case = Case("checkpointed compiled blocks", lambda: CheckpointedCompiled(counting("aot_eager", runs)), _x)
    reports = run_equality(case, fractions=(0.5, 0.0), replays=2)
    # measure + 2 budgets x 3 steps x 2 runs, each: 2 forwards and 2 recomputations
    assert len(runs) == 4 * (1 + 2 * 3 * 2)
    assert all(r.bytes_d2h > 0 for r in reports[0.0])


def test_activations_saved_inside_a_compiled_region_are_offloaded() -> None:
    runs: list[int] = []
    torch.manual_seed(0)
    model = _compiled_model(counting("aot_eager", runs))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with session:
            model(torch.tanh(_x(step)[0])).square().sum().backward()
    trace, schedule = session.trace, session.schedule
    names = [op.name for op in trace.ops]
    assert names.count("compiled(Block)") == 3 and names.count("compiled(Block).backward") == 3
    moved = {a.storage_id for _, _, a in schedule.actions() if a.kind is ResidencyActionType.COPY_D2H}
    made_by_region = set()
    for op in trace.ops:
        if op.name == "compiled(Block)":
            made_by_region |= {acc.storage_id for acc in op.accesses if acc.kind.name == "WRITE"}
    # A block's output, and what it saved for backward (gelu's input, up's output...)
    assert len(made_by_region) > 3 and made_by_region & moved
    assert session.last_report.bytes_d2h > 0 and session.last_report.diverged_at is None


def test_a_compiled_function_outside_a_region_raises_and_is_not_spoiled() -> None:
    runs: list[int] = []
    fn = torch.compile(lambda t: (t.sin() * 2).cos(), backend=counting("inductor", runs))
    x = torch.randn(64, requires_grad=True)
    fn(x)  # compiled and cached outside: the session must not run the cached code blindly
    fresh = torch.compile(lambda t: t.exp() + 1, backend=counting("inductor", runs))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for compiled in (fn, fresh):
        with pytest.raises(OffloadCompileError, match="skip_offload"), session:
            compiled(x.tanh()).sum().backward()
        assert session.tracked_storages() == 0 and OffloadSession.get_active() is None
    before = len(runs)
    fn(x), fresh(x)  # outside the session both still run compiled
    assert len(runs) == before + 2
    wrapped = skip_offload(fn)
    grads = []
    for use_session in (False, True, True):
        x.grad = None
        if use_session:
            with session:
                wrapped(x.tanh()).sum().backward()
        else:
            wrapped(x.tanh()).sum().backward()
        grads.append(x.grad.clone())
    assert len(runs) == before + 5
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    assert session.last_report.phase == "replay" and session.last_report.diverged_at is None


def test_a_module_compiled_in_place_needs_skip_offload() -> None:
    runs: list[int] = []
    torch.manual_seed(0)
    block = Block()
    block.compile(backend=counting("aot_eager", runs))
    x = torch.randn(8, 32)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with pytest.raises(OffloadCompileError, match=r"module.compile\(\)"), session:
        block(x.tanh()).sum().backward()
    wrapped = skip_offload(block)
    grads = []
    for use_session in (False, True, True):
        block.zero_grad(set_to_none=True)
        if use_session:
            with session:
                wrapped(x.tanh()).square().sum().backward()
        else:
            wrapped(x.tanh()).square().sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    assert len(runs) == 3
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g, strict=True))
    assert session.last_report.bytes_d2h > 0


def test_an_error_inside_a_compiled_region_leaves_the_session_usable() -> None:
    runs: list[int] = []
    torch.manual_seed(0)
    block = torch.compile(Block(), backend=counting("aot_eager", runs))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with pytest.raises(RuntimeError, match="reduction dim"), session:
        block(torch.randn(8, 31)).sum().backward()  # the wrong width: fails inside the region
    assert OffloadSession.get_active() is None and session.tracked_storages() == 0
    x = torch.randn(8, 32)
    with session:
        block(x.tanh()).square().sum().backward()
    assert session.last_report.phase == "warmup" and session.last_report.bytes_d2h > 0
    assert runs
