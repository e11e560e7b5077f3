"""Bitwise equality with the asynchronous thread engine, including one that delays every copy.

A missing wait (an op reading bytes still arriving, a free while a copy reads, a slab
overwritten while a copy reads it) shows as a difference once every copy is slow.
"""

from __future__ import annotations

import pytest
import torch

from hyperpar.models import GPT, GPTConfig, Llama, LlamaConfig, random_batch
from hyperpar.offload.runtime import ThreadCopyEngine
from tests.offload.equality_harness import Case, run_equality


def _gpt_case() -> Case:
    cfg = GPTConfig.tiny()
    batches = [random_batch(cfg, 2, torch.Generator().manual_seed(i)) for i in range(4)]
    return Case("gpt-tiny", lambda: GPT(cfg), lambda step: batches[step],
                loss=lambda model, args: model.loss(*args))


def _llama_case() -> Case:
    cfg = LlamaConfig.tiny()
    batches = [random_batch(cfg, 2, torch.Generator().manual_seed(10 + i)) for i in range(4)]
    return Case("llama-tiny", lambda: Llama(cfg), lambda step: batches[step],
                loss=lambda model, args: model.loss(*args))


@pytest.mark.parametrize("case", [_gpt_case(), _llama_case()], ids=lambda c: c.name)
def test_delayed_thread_engine_keeps_gradients_bitwise_equal(case: Case) -> None:
    torch.set_num_threads(1)
    engine = ThreadCopyEngine(delay_s=0.0005)
    reports = run_equality(case, fractions=(0.5, 0.0), replays=2, copy_engine=engine)
    replay = reports[0.0][-1]
    assert replay.bytes_d2h > 0 and replay.bytes_h2d > 0
    assert replay.exposed_wait_ms > 0.0  # the slow copies were really waited on
    assert replay.predicted_step_ms is not None and replay.predicted_step_ms > 0


def test_default_engine_on_cpu_is_the_thread_engine_and_stays_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    # "auto" is the thread engine unless HYPERPAR_COPY_ENGINE says otherwise (CI sets it)
    monkeypatch.delenv("HYPERPAR_COPY_ENGINE", raising=False)
    from hyperpar.offload import OffloadConfig, OffloadSession

    assert OffloadSession(OffloadConfig(device="cpu")).copy_engine_name == "thread"
    reports = run_equality(_gpt_case(), fractions=(0.3,), replays=2)
    assert all(r.bytes_d2h > 0 for r in reports[0.3][1:])
