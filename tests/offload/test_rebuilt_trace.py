"""The trace of a step with calls rebuilt, made from the trace without them, is the trace the
rebuilt step records: the same ops and the same activation memory."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning.arrays import kept_and_movable_peak, trace_arrays
from hyperpar.offload.planning.levers.layer_blocks import forward_end_of, repeated_blocks
from hyperpar.offload.planning.levers.rebuilt_trace import rebuilt_trace
from tests.offload.test_recompute import Net

Built = tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]


def _net() -> Built:
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    return Net(64), lambda m: m(x)


def _llama() -> Built:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=3, vocab_size=256,
                                   use_cache=False)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(cfg), lambda m: m(input_ids=ids, labels=ids).loss


def _movable_peak(trace: ActivationTrace) -> int:
    return kept_and_movable_peak(trace_arrays(trace), trace.retained_sids)[1]


@pytest.mark.parametrize("build", [_net, _llama], ids=["blocks", "hf-llama"])
def test_the_rebuilt_trace_is_the_trace_of_the_rebuilt_step(build: Callable[[], Built]) -> None:
    torch.set_num_threads(1)
    model, loss = build()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6, recompute="layers"))
    traces = []
    for _ in range(3):  # warmup, the checked replay that chooses, the rebuilt step traced
        with session:
            loss(model).backward()
        model.zero_grad(set_to_none=True)
        assert session.trace is not None
        traces.append(session.trace)
    plain, real = traces[0], traces[2]
    assert session.last_report is not None and session.last_report.bytes_recomputed > 0
    choice = session._recompute_choice
    assert choice is not None and choice.regions
    spans = [span for r in choice.regions for span in r.spans]
    made = rebuilt_trace(plain, spans, choice.forward_end)
    assert _movable_peak(made) < _movable_peak(plain)
    # a little optimistic: the real rebuilt call holds its outputs' gradients through its
    # whole backward (``torch.autograd.grad``), which the trace of the plain step cannot show
    assert 0.85 * _movable_peak(real) <= _movable_peak(made) <= _movable_peak(real)
    assert sum(made.storage_sizes.values()) == sum(real.storage_sizes.values())
    # the same ops but a few bookkeeping ones per rebuilt call (none here)
    extra = Counter(op.name for op in real.ops) - Counter(op.name for op in made.ops)
    missing = Counter(op.name for op in made.ops) - Counter(op.name for op in real.ops)
    assert not missing and sum(extra.values()) <= 2 * len(spans), extra
    assert len(made.guides) == len(made.ops)


def test_no_span_frees_anything_gives_the_same_trace() -> None:
    torch.set_num_threads(1)
    model, loss = _net()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    with session:
        loss(model).backward()
    assert session.trace is not None
    assert rebuilt_trace(session.trace, [], 10) is session.trace
    assert rebuilt_trace(session.trace, [(0, 0)], 10) is session.trace


@pytest.mark.parametrize("build", [_net, _llama], ids=["blocks", "hf-llama"])
def test_a_saved_trace_shows_its_layers(build: Callable[[], Built]) -> None:
    """Without module calls (a trace saved to a file), the repeated blocks of forward are the
    layers the session's own module calls show."""
    torch.set_num_threads(1)
    model, loss = build()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6, recompute="layers"))
    for _ in range(2):
        with session:
            loss(model).backward()
        model.zero_grad(set_to_none=True)
    choice = session._recompute_choice
    assert session.trace is not None and choice is not None
    layers = sorted(span for r in choice.regions for span in r.spans)
    assert repeated_blocks(session.trace, forward_end_of(session.trace)) == layers
    assert forward_end_of(session.trace) >= choice.forward_end - 2  # the first op named as backward
