"""OffloadTrainer: a Hugging Face Trainer whose micro-batches run in an OffloadSession trains a
tiny Llama exactly as the plain Trainer does (every micro-batch's loss and the final weights,
bitwise), with gradient accumulation, while offloading."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hyperpar.integrations.hf import OffloadTrainer
from hyperpar.offload import OffloadConfig, OffloadSession, StepReport

pytestmark = pytest.mark.hf
VOCAB, SEQ = 128, 16


class _Recording:
    """Keeps every micro-batch's loss (and the session's report, when there is one)."""

    losses: list[torch.Tensor]
    reports: list[StepReport]

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)  # type: ignore[misc]
        self.losses.append(loss.clone())
        session = getattr(self, "offload_session", None)
        if session is not None:
            self.reports.append(session.last_report)
        return loss


class _Plain(_Recording, Trainer):
    pass


class _Offloaded(_Recording, OffloadTrainer):
    pass


def _train(cls: type, tmp_path: Any, **kwargs: Any) -> Any:
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (16, SEQ), generator=gen)]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3, seed=0, data_seed=0,
                             dataloader_num_workers=0, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, logging_steps=1)
    trainer = cls(model=LlamaForCausalLM(config), args=args, train_dataset=data, **kwargs)
    trainer.losses, trainer.reports = [], []
    trainer.train()
    return trainer


def test_offload_trainer_matches_the_plain_trainer_bitwise(tmp_path: Any) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = _train(_Plain, tmp_path)
        probe = _train(_Offloaded, tmp_path, offload=OffloadConfig(max_resident_activation_mb=1e9))
        peak = max(r.peak_resident_bytes for r in probe.reports)
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.4 * peak / (1 << 20)))
        offloaded = _train(_Offloaded, tmp_path, offload=session)
    finally:
        torch.set_num_threads(threads)
    assert len(plain.losses) == 8  # 4 optimizer steps x 2 micro-batches
    assert [x.item().hex() for x in offloaded.losses] == [x.item().hex() for x in plain.losses]
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters(), strict=True):
        assert torch.equal(a, b)
    reports = offloaded.reports
    assert all(r.bytes_d2h > 0 for r in reports)
    # the two kinds of micro-batch (.grad created, .grad accumulated) each get a plan; the last
    # optimizer step replays both without divergence
    assert [r.phase for r in reports[-2:]] == ["replay", "replay"]
    assert all(r.diverged_at is None for r in reports[-2:])


def test_offload_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="offload="):
        OffloadTrainer(model=torch.nn.Linear(2, 2), offload="half")  # type: ignore[arg-type]
