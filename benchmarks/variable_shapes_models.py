"""Hugging Face models trained with another batch size and sequence length every step, in an
OffloadSession: is every step bitwise equal to plain PyTorch, and within its budget?

For each model (random weights from a small config): batch 1..4 and length 16..200 drawn
every step; GPT-2 and BERT with an attention mask padding each row at a random point (and
their dropout: both runs are seeded alike); Llama with its batch split into two micro-batches
of different lengths (gradient accumulation) and with each MLP compiled
(``torch.compile(dynamic=True)``, a compiled region in the step). The budget is 40 % of the
activation peak of one probe step. A step counts as over budget when its peak is above
1.05x the budget while its own floor is within the budget (replay allows itself 64 KiB of
slack, more than 5 % of the small budgets here). One torch thread.

    .venv/bin/python benchmarks/variable_shapes_models.py --out benchmarks/results/variable_shapes_models.json
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
from typing import Any

import torch
from tqdm import tqdm

from hyperpar.bench.headlines import write
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20
MODELS = ("gpt2-padded", "bert-padded", "mixtral", "llama-accumulated", "llama-compiled")


def _build(name: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512))
    if name == "gpt2-padded":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2,
                                                                    n_head=4, n_positions=512))
    if name == "bert-padded":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=512))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512))
    if name == "llama-compiled":
        for layer in model.model.layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
    return model


def _batch(name: str, step: int, rng: random.Random) -> dict[str, torch.Tensor]:
    rows, length = rng.randint(1, 4), rng.randint(16, 200)
    ids = torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(step))
    batch = {"input_ids": ids, "labels": ids}
    if name.endswith("-padded"):
        mask = torch.ones(rows, length, dtype=torch.long)
        for r in range(rows):
            mask[r, rng.randint(length // 2, length):] = 0
        batch["attention_mask"] = mask
    return batch


def _run(name: str, model: torch.nn.Module, batch: dict[str, torch.Tensor], session: OffloadSession | None,
         seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # dropout draws the same in both runs

    def body() -> torch.Tensor:
        if name == "llama-accumulated":
            ids = batch["input_ids"]
            half = max(ids.shape[1] // 2, 1)
            for part in (ids[:, :half], ids[:, half:]):
                if part.shape[1]:
                    model(input_ids=part, labels=part).loss.backward()
            return torch.zeros(())
        out = model(**batch)
        out.loss.backward()
        return out.loss.detach()

    if session is None:
        return body()
    with session:
        return body()


def measure(name: str, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    plain, offloaded = _build(name), _build(name)
    offloaded.load_state_dict(plain.state_dict())
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    _run(name, offloaded, _batch(name, 999, random.Random(5)), probe, 0)
    offloaded.zero_grad(set_to_none=True)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    rng = random.Random(1)
    rows = []
    for step in range(steps):
        batch = _batch(name, step, rng)
        a, b = _run(name, plain, batch, None, step), _run(name, offloaded, batch, session, step)
        report = session.last_report
        assert report is not None
        pairs = zip(plain.parameters(), offloaded.parameters(), strict=True)
        equal = torch.equal(a, b) and all(torch.equal(p.grad, q.grad) for p, q in pairs
                                          if p.grad is not None or q.grad is not None)
        floor = report.min_feasible_budget_bytes
        rows.append({"shape": list(batch["input_ids"].shape), "phase": report.phase,
                     "replay_path": report.replay_path, "bitwise_equal": equal,
                     "peak_over_budget": report.peak_resident_bytes / budget,
                     "floor_over_budget": None if floor is None else floor / budget,
                     "diverged_at": report.diverged_at})
        plain.zero_grad(set_to_none=True)
        offloaded.zero_grad(set_to_none=True)
    # A step that fell back at its first saved tensor (a size no plan covers) reports no
    # floor: its own sizes were never traced. Those are listed apart, not counted feasible.
    over = [r for r in rows if r["peak_over_budget"] > 1.05
            and r["floor_over_budget"] is not None and r["floor_over_budget"] <= 1.0]
    unknown = [r for r in rows if r["peak_over_budget"] > 1.05 and r["floor_over_budget"] is None]
    return {"budget_bytes": budget, "steps": rows, "warmups": sum(r["phase"] == "warmup" for r in rows),
            "not_bitwise": sum(not r["bitwise_equal"] for r in rows),
            "over_budget_when_feasible": [round(r["peak_over_budget"], 3) for r in over],
            "over_budget_floor_unknown": [round(r["peak_over_budget"], 3) for r in unknown],
            "worst_peak_over_budget_when_feasible": max(
                (r["peak_over_budget"] for r in rows
                 if r["floor_over_budget"] is not None and r["floor_over_budget"] <= 1.0), default=0.0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = provenance()
    results = {}
    for name in tqdm(args.models.split(","), desc="models", file=sys.stderr):
        results[name] = measure(name, args.steps)
        r = results[name]
        print(f"{name}: {args.steps} steps, {r['warmups']} warmup(s), not bitwise {r['not_bitwise']}, "
              f"over 1.05x a feasible budget {r['over_budget_when_feasible']}, "
              f"worst {r['worst_peak_over_budget_when_feasible']:.2f}; over 1.05x, floor unknown "
              f"{r['over_budget_floor_unknown']}")
    if args.out:
        machine = {"platform": platform.platform(), "python": platform.python_version(), "threads": 1}
        doc = {"benchmark": "variable_shapes_models", "command": " ".join(sys.argv),
               "torch": torch.__version__, "machine": machine, "models": results}
        write("variable_shapes_models", args.out, doc, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
