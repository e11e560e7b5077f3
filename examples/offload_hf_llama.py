"""Offload a Hugging Face Llama's activations at 40 % of their measured peak.

The model is built from a config with random weights (nothing is downloaded). The script
measures the activation peak of one step, then trains a few steps in an OffloadSession
with a budget of 40 % of that peak, prints each step's StepReport, and checks that the
losses are bitwise equal to the same steps without offload.

    python examples/offload_hf_llama.py            # small: about a minute on 2 CPU cores
    python examples/offload_hf_llama.py --size tiny
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hyperpar.offload import OffloadConfig, OffloadSession

SIZES = {  # (hidden, layers, heads, kv heads, intermediate, vocab, seq, batch)
    "tiny": (32, 2, 4, 2, 64, 128, 32, 2),
    "small": (256, 4, 8, 4, 688, 2000, 256, 4),
}
MIB = 1 << 20


def build(size: str, seed: int) -> tuple[LlamaForCausalLM, list[torch.Tensor]]:
    hidden, layers, heads, kv_heads, inter, vocab, seq, batch = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(8)]
    return model, batches


def train(model: LlamaForCausalLM, batches: list[torch.Tensor], steps: int,
          session: OffloadSession | None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        if session is None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        else:
            with session:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            print(f"step {step}: {session.last_report}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.4, help="budget / measured peak (default 0.4)")
    args = parser.parse_args()

    # 1. Measure: one step under a session with no real budget records the activation peak.
    model, batches = build(args.size, seed=0)
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e9, device="cpu"))
    with probe:
        model(input_ids=batches[0], labels=batches[0]).loss.backward()
    peak = probe.last_report.peak_resident_bytes
    budget_mb = args.fraction * peak / MIB
    print(f"activation peak {peak / MIB:.2f} MiB -> budget {budget_mb:.2f} MiB ({args.fraction:.0%})")

    # 2. Train with offload at that budget (the first step traces, the next ones replay the plan).
    model, batches = build(args.size, seed=0)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb, device="cpu"))
    with_offload = train(model, batches, args.steps, session)

    # 3. The same steps without offload: the losses must match bit for bit.
    model, batches = build(args.size, seed=0)
    plain = train(model, batches, args.steps, None)
    same = [x.hex() for x in with_offload] == [x.hex() for x in plain]
    print(f"losses with offload {with_offload}\nlosses without      {plain}\nbitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
