"""The warmup makes room for an op's output before the op runs. For ops that make more than
they read (a widening cast, a matrix multiply wider than its operands, a factory op) the
room is computed from the arguments (``output_bytes``); budgeting what the op had read put
their first call's output on top of a full budget (HF GPT-2 under autocast: 1.10x)."""

from __future__ import annotations

import random

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.capture.ops.output_bytes import PREDICTORS, predicted_bytes
from tests.step_context import step_context

MIB = 1 << 20
aten = torch.ops.aten
CPU = torch.device("cpu")


def _calls(rng: random.Random) -> list[tuple[object, tuple, dict]]:
    m, k, n, b = (rng.randint(1, 9) for _ in range(4))
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    x = torch.randn(m, k).to(dtype)
    return [
        (aten._to_copy.default, (x,), {"dtype": rng.choice([torch.float32, torch.bfloat16, torch.int64])}),
        (aten._to_copy.default, (x.t().expand(3, k, m),), {}),
        (aten._to_copy.default, (x,), {"dtype": torch.float64, "device": "cpu"}),
        (aten.mm.default, (x, torch.randn(k, n).to(dtype)), {}),
        (aten.addmm.default, (torch.randn(n).to(dtype), x, torch.randn(k, n).to(dtype)), {}),
        (aten.bmm.default, (torch.randn(b, m, k).to(dtype), torch.randn(b, k, n).to(dtype)), {}),
        (aten.baddbmm.default, (torch.randn(b, m, n).to(dtype), torch.randn(b, m, k).to(dtype),
                                torch.randn(b, k, n).to(dtype)), {}),
        (aten.zeros.default, ([m, n],), {"dtype": dtype}),
        (aten.ones.default, ([m, n, b],), {}),
        (aten.full.default, ([m], 2.0), {"dtype": dtype}),
        (aten.full.default, ([m, n], rng.choice([3, True, 2.5, 1j])), {}),
        (aten.empty.memory_format, ([m, k],), {}),
        (aten.randn.default, ([b, n],), {}),
        (aten.rand.default, ([b, n],), {"dtype": torch.float64}),
        (aten.new_zeros.default, (x, [n, b]), {}),
        (aten.new_ones.default, (x, [n]), {"dtype": torch.float32}),
        (aten.new_empty.default, (x, [b, b]), {}),
        (aten.new_full.default, (x, [m], 3.0), {}),
        (aten.mul.Tensor, (x, torch.randn(m, k).to(dtype)), {}),
        (aten.add.Tensor, (x.t(), torch.randn(k, m).to(dtype)), {"alpha": 2}),  # a view
        (aten.sub.Tensor, (x[:1].expand(m, k), x), {}),  # an expanded input: the full result
        (aten.div.Tensor, (x, x), {}),
    ]


@pytest.mark.parametrize("seed", range(8))
def test_predicted_bytes_are_the_bytes_the_op_makes(seed: int) -> None:
    seen = set()
    for func, args, kwargs in _calls(random.Random(seed)):
        out = func(*args, **kwargs)
        made = out.untyped_storage().nbytes()
        assert predicted_bytes(func, args, kwargs, CPU) == made, (func, args, kwargs)
        seen.add(func)
    assert seen == set(PREDICTORS), "every predictor is checked against its op"


def test_pointwise_ops_other_than_same_shape_and_dtype_are_left_to_the_learned_ratio() -> None:
    x = torch.randn(4, 1)
    for func, args in [(aten.mul.Tensor, (x, torch.randn(1, 8))),  # broadcasting: 8x the inputs
                       (aten.add.Tensor, (x, x.double())),  # promotion
                       (aten.mul.Tensor, (x, torch.tensor(2.0))),  # a 0-dim tensor
                       (aten.div.Tensor, (x, 2.0))]:  # a Python scalar
        assert predicted_bytes(func, args, {}, CPU) is None, (func, args)


def test_other_devices_and_unknown_arguments() -> None:
    x = torch.randn(4, 4)
    assert predicted_bytes(aten._to_copy.default, (x,), {"device": torch.device("meta")}, CPU) == 0
    assert predicted_bytes(aten.zeros.default, ([4, 4],), {"device": "meta"}, CPU) == 0
    assert predicted_bytes(aten._to_copy.default, (x,), {}, torch.device("meta")) == 0
    assert predicted_bytes(aten.mm.default, (1, 2), {}, CPU) is None  # not tensors: the learned ratio
    assert predicted_bytes(aten.zeros.default, ("four",), {}, CPU) is None
    assert predicted_bytes(aten.relu.default, (x,), {}, CPU) is None  # no predictor


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 64, generator=g) / 8).requires_grad_() for _ in range(8)]


def _step(x: torch.Tensor, ws: list[torch.Tensor], head: torch.Tensor) -> torch.Tensor:
    """bf16 layers that fill the budget, then ops that make more than they read, each for the
    first time: a widening cast, a factory op, a matrix multiply wider than its operands."""
    h = x
    for w in ws:
        h = torch.tanh(h @ w.to(torch.bfloat16))
    wide = h.float()  # twice the bytes it reads
    shift = torch.zeros(wide.shape[0], wide.shape[1])  # reads nothing
    logits = (wide + shift) @ head  # [2048, 256] fp32 from [2048, 64] and [64, 256]
    loss = logits.logsumexp(-1).mean()
    loss.backward()
    return loss.detach()


def _run(session: OffloadSession | None, x: torch.Tensor, ws: list[torch.Tensor],
         head: torch.Tensor) -> tuple[torch.Tensor, ...]:
    for w in [*ws, head]:
        w.grad = None
    with step_context(session):
        loss = _step(x, ws, head)
    return (loss, *(w.grad for w in [*ws, head]))


@pytest.mark.parametrize("fraction", [0.4, 0.5, 0.6])
def test_warmup_keeps_the_budget_at_ops_that_make_more_than_they_read(fraction: float) -> None:
    """Before: 1.22x the budget at 40 % (the head's matrix multiply budgeted as its operands)."""
    torch.set_num_threads(1)
    ws = _weights()
    head = (torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) / 8).requires_grad_()
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    _run(probe, x, ws, head)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * fraction)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    expected = _run(None, x, ws, head)
    got = _run(session, x, ws, head)
    report = session.last_report
    assert report is not None and report.phase == "warmup"
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    floor = report.min_feasible_budget_bytes or 0
    assert floor <= budget, f"the budget must be feasible for this test: {report}"
    assert report.peak_resident_bytes <= budget, report


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_hf_gpt2_under_autocast_keeps_the_budget_from_its_first_step(where: str) -> None:
    """Mixed precision as users write it, autocast inside the session or around it: bitwise equal
    to plain every step, the warmup within the budget (before: 1.10x at the fp32 upcast of the
    logits), the replays too."""
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

    def step(m: torch.nn.Module, ids: torch.Tensor, session: OffloadSession | None) -> torch.Tensor:
        cast = torch.autocast("cpu", dtype=torch.bfloat16)
        if session is None:
            with cast:
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        elif where == "inside":
            with session:
                with cast:
                    loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
        else:
            with cast, session:
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
        return loss.detach()

    plain, off = model(), model()
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    step(off, ids, probe)
    off.zero_grad(set_to_none=True)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    for i in range(3):
        expected, got = step(plain, ids, None), step(off, ids, session)
        report = session.last_report
        assert report is not None and report.phase == ("warmup" if i == 0 else "replay")
        assert torch.equal(expected, got), report
        for (name, a), b in zip(plain.named_parameters(), off.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), f"step {i}: grad of {name}"
        assert (report.min_feasible_budget_bytes or 0) <= budget, report
        assert report.peak_resident_bytes <= budget, f"step {i}: {report}"
        plain.zero_grad(set_to_none=True)
        off.zero_grad(set_to_none=True)
