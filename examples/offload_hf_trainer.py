"""Train a Hugging Face Llama with the Trainer, its activations offloaded at 40 % of their peak.

``OffloadTrainer`` is ``transformers.Trainer`` with every micro-batch (forward and backward,
``training_step``) inside an ``OffloadSession``; ``OffloadTrainerMixin`` does the same for
another Trainer class (``class MyTrainer(OffloadTrainerMixin, SFTTrainer)``). The model is
built from a config with random weights (nothing is downloaded). The script measures the
activation peak, trains with gradient accumulation at 40 % of it, trains the same steps with
the plain Trainer, and checks that the final weights are bitwise equal.

    .venv/bin/python examples/offload_hf_trainer.py            # small: about a minute on 2 CPU cores
    .venv/bin/python examples/offload_hf_trainer.py --size tiny
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hyperpar.integrations.hf import OffloadTrainer
from hyperpar.offload import OffloadConfig, OffloadSession

SIZES = {  # (hidden, layers, heads, kv heads, intermediate, vocab, seq, batch)
    "tiny": (32, 2, 4, 2, 64, 128, 32, 2),
    "small": (256, 4, 8, 4, 688, 2000, 256, 4),
}
MIB = 1 << 20


def train(size: str, steps: int, offload: OffloadSession | None, out_dir: str) -> Trainer:
    hidden, layers, heads, kv_heads, inter, vocab, seq, batch = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=seq, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4 * batch * steps, seq), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=2, learning_rate=1e-3, seed=0, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1,
                             dataloader_num_workers=0)
    model = LlamaForCausalLM(config)
    if offload is None:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    else:
        trainer = OffloadTrainer(model=model, args=args, train_dataset=data, offload=offload)
    trainer.train()
    return trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (2 micro-batches each)")
    parser.add_argument("--fraction", type=float, default=0.4, help="budget / measured peak (default 0.4)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # bitwise comparison: one thread is run-to-run deterministic
    with tempfile.TemporaryDirectory() as out_dir:
        # 1. Measure: one optimizer step with no real budget records the activation peak.
        probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9))
        train(args.size, 1, probe, out_dir)
        peak = probe.last_report.peak_resident_bytes
        budget_mb = args.fraction * peak / MIB
        print(f"activation peak {peak / MIB:.2f} MiB -> budget {budget_mb:.2f} MiB ({args.fraction:.0%})")

        # 2. The Trainer with offload (the first micro-batches trace, the next ones replay).
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb))
        offloaded = train(args.size, args.steps, session, out_dir)
        print(f"last micro-batch: {session.last_report}")

        # 3. The plain Trainer on the same data: the weights must match bit for bit.
        plain = train(args.size, args.steps, None, out_dir)
    same = all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), offloaded.model.parameters(),
                                                 strict=True))
    print(f"final weights bitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
