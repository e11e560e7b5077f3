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


def _train(cls: type, tmp_path: Any, use_cache: bool = True, **kwargs: Any) -> Any:
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         use_cache=use_cache)
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


def test_offload_trainer_with_layers_rebuilt_matches_the_plain_trainer_bitwise(tmp_path: Any) -> None:
    """Recompute composes with the Trainer: every layer rebuilt in backward, the rest offloaded,
    gradient accumulation on, the same losses and weights as the plain Trainer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = _train(_Plain, tmp_path, use_cache=False)
        session = OffloadSession(OffloadConfig(max_resident_fraction=0.5, recompute="layers"))
        offloaded = _train(_Offloaded, tmp_path, offload=session, use_cache=False)
    finally:
        torch.set_num_threads(threads)
    assert [x.item().hex() for x in offloaded.losses] == [x.item().hex() for x in plain.losses]
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert any(r.bytes_recomputed > 0 for r in offloaded.reports)
    assert all(r.peak_resident_bytes <= r.budget_bytes for r in offloaded.reports[1:])


def test_offload_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="offload="):
        OffloadTrainer(model=torch.nn.Linear(2, 2), offload="half")  # type: ignore[arg-type]


def _padded(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding: each batch as long as its longest example."""
    longest = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, example in enumerate(batch):
        n = len(example["input_ids"])
        ids[row, :n], mask[row, :n], labels[row, :n] = example["input_ids"], 1, example["input_ids"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _train_padded(cls: type, tmp_path: Any, **kwargs: Any) -> Any:
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 65, (32,), generator=gen).tolist()
    data = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen)} for n in lengths]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3, seed=0, data_seed=0,
                             dataloader_num_workers=0, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, logging_steps=1, remove_unused_columns=False)
    trainer = cls(model=LlamaForCausalLM(config), args=args, train_dataset=data, data_collator=_padded,
                  **kwargs)
    trainer.losses, trainer.reports = [], []
    trainer.train()
    return trainer


def test_dynamic_padding_replays_one_plan_within_the_budget_bitwise(tmp_path: Any) -> None:
    """Issue 12 through a real client: every batch padded to its own longest example (8..64
    tokens), so nearly every micro-batch has another length; one warmup, then replays, the
    same losses and weights as the plain Trainer, and every step within the budget (and
    replay's 64 KiB of slack) wherever the budget is feasible at its size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = _train_padded(_Plain, tmp_path)
        probe = _train_padded(_Offloaded, tmp_path, offload=OffloadConfig(max_resident_activation_mb=1e9))
        budget = int(0.4 * max(r.peak_resident_bytes for r in probe.reports))
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / (1 << 20)))
        offloaded = _train_padded(_Offloaded, tmp_path, offload=session)
    finally:
        torch.set_num_threads(threads)
    assert [x.item().hex() for x in offloaded.losses] == [x.item().hex() for x in plain.losses]
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters(), strict=True):
        assert torch.equal(a, b)
    reports = offloaded.reports
    assert [r.phase for r in reports].count("warmup") == 1, [r.phase for r in reports]
    assert sum(r.bytes_d2h > 0 for r in reports) >= len(reports) // 2
    for r in reports:
        if r.min_feasible_budget_bytes is not None and r.min_feasible_budget_bytes <= budget:
            assert r.peak_resident_bytes <= max(1.05 * budget, budget + (64 << 10)), r
