"""FastArithmetic: a step traced with its heavy arithmetic skipped records the ops, storage
sizes and output shapes and dtypes of the real step; the skipped ops' outputs are zeros."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.projection import FastArithmetic, fast_arithmetic

transformers = pytest.importorskip("transformers")


def _llama(use_cache: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    model.config.use_cache = use_cache
    return model.to(torch.bfloat16)


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def _config(**more: Any) -> OffloadConfig:
    return OffloadConfig(max_resident_activation_mb=1 << 20, device="cpu", **more)


def _traced(model: torch.nn.Module, fast: FastArithmetic | None) -> tuple[ActivationTrace, torch.Tensor]:
    """One forward and backward of ``model`` in a fresh session (under ``fast`` if given)."""
    session = OffloadSession(_config())
    if fast is None:
        with session:
            loss = model(input_ids=_ids(), labels=_ids()).loss
            loss.backward()
    else:
        with fast, session:
            loss = model(input_ids=_ids(), labels=_ids()).loss
            loss.backward()
    assert session.trace is not None
    return session.trace, loss.detach()


def _sizes(trace: ActivationTrace) -> list[list[int]]:
    return [[trace.storage_sizes[a.storage_id] for a in op.accesses] for op in trace.ops]


def test_a_bf16_llama_step_records_the_trace_of_real_arithmetic() -> None:
    torch.set_num_threads(1)
    model = _llama()
    real, _ = _traced(copy.deepcopy(model), None)
    fast = FastArithmetic()
    skipped, loss = _traced(copy.deepcopy(model), fast)
    assert [op.name for op in skipped.ops] == [op.name for op in real.ops]
    assert _sizes(skipped) == _sizes(real)
    assert [[a.kind for a in op.accesses] for op in skipped.ops] == [[a.kind for a in op.accesses]
                                                                      for op in real.ops]
    assert len(skipped.retained_sids) == len(real.retained_sids)
    # the guides hold each op's output shapes and dtypes (bf16 throughout, as really run)
    assert skipped.guides and [g.output_meta for g in skipped.guides] == [g.output_meta for g in real.guides]
    assert skipped.guides == real.guides
    # the heavy ops were answered, not run: matmuls forward and backward, attention both ways
    assert fast.skipped == sum(fast.skipped_by_op.values()) > 0
    assert fast.skipped_by_op["aten.mm.default"] > 0
    assert fast.skipped_by_op["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 2
    assert fast.skipped_by_op["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] == 2
    assert fast.skipped == sum(op.name in fast.skipped_by_op for op in real.ops)
    # zero logits: the loss is log(vocab), finite
    assert torch.isfinite(loss) and loss.item() == pytest.approx(math.log(256), rel=1e-2)


def test_heavy_ops_give_zeros_of_the_real_shape_stride_and_dtype() -> None:
    a = torch.randn(8, 5, dtype=torch.bfloat16)
    b = torch.randn(6, 5, dtype=torch.bfloat16).t()  # a transposed operand
    batch = torch.randn(3, 8, 5), torch.randn(3, 5, 4)
    calls = {
        "mm": lambda: torch.mm(a, b),
        "addmm": lambda: torch.addmm(torch.ones(6, dtype=torch.bfloat16), a, b),
        "bmm": lambda: torch.bmm(*batch),
        "baddbmm": lambda: torch.baddbmm(torch.ones(3, 8, 4), *batch),
        "addbmm": lambda: torch.addbmm(torch.ones(8, 4), *batch),
        "convolution": lambda: torch.nn.functional.conv2d(torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3),
                                                          torch.ones(4), stride=2),
    }
    fast = FastArithmetic()
    for name, call in calls.items():
        expected = call()
        with fast:
            got = call()
        assert (got.shape, got.stride(), got.dtype, got.device) == (
            expected.shape, expected.stride(), expected.dtype, expected.device), name
        assert expected.count_nonzero() > 0 and got.count_nonzero() == 0, name
        assert fast.skipped_by_op[f"aten.{name}.default"] == 1, name
    assert fast.skipped == len(calls)


def test_other_ops_and_out_variants_run_for_real() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    out = torch.empty(4, 4)
    with FastArithmetic() as fast:
        added = a + b
        torch.mm(a, b, out=out)
    assert torch.equal(added, torch.add(a, b)) and torch.equal(out, torch.mm(a, b))
    assert fast.skipped == 0


def test_an_op_without_a_meta_kernel_runs_for_real_said_once(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    lib = torch.library.Library("hyperpar_fa_test", "FRAGMENT")  # an op with no meta kernel
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")
    op = torch.ops.hyperpar_fa_test.double.default
    monkeypatch.setattr(fast_arithmetic, "HEAVY_OPS", fast_arithmetic.HEAVY_OPS | {op})
    x = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger=fast_arithmetic.__name__), FastArithmetic() as fast:
        first, second = op(x), op(x)
    assert torch.equal(first, x * 2) and torch.equal(second, x * 2) and fast.skipped == 0
    said = [r.getMessage() for r in caplog.records if "hyperpar_fa_test" in r.getMessage()]
    assert len(said) == 1 and "runs for real" in said[0], said


def test_recompute_layers_steps_run_under_it() -> None:
    """Rebuilt layers are checked against the byte sums of their forward outputs: zeros both
    times, so four steps (warmup, checked, rebuilding, checked) pass."""
    torch.set_num_threads(1)
    model = _llama(use_cache=False)
    session = OffloadSession(_config(recompute="layers"))
    fast = FastArithmetic()
    rebuilt = []
    for _ in range(4):
        with fast, session:
            loss = model(input_ids=_ids(), labels=_ids()).loss
            loss.backward()
        assert torch.isfinite(loss)
        assert session.last_report is not None
        rebuilt.append(session.last_report.bytes_recomputed > 0)
        model.zero_grad(set_to_none=True)
    assert session._recompute is not None and rebuilt[-1], rebuilt
    assert fast.skipped > 0


def test_entered_inside_a_session_it_raises() -> None:
    session = OffloadSession(_config())
    with pytest.raises(RuntimeError, match=r"before \(outside\) the OffloadSession"):
        with session, FastArithmetic():
            pass
    # the session is usable again, in the right order
    with FastArithmetic() as fast, session:
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert fast.skipped == 1
