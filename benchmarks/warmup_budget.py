"""Does the first step (the warmup, online eviction) keep its budget? HF models, with and
without autocast, at several budgets.

The warmup makes room for an op's output before the op runs; where it budgets too little,
the output lands on top of a full budget and the step's peak is over it until the next op
evicts. Ops that make more than they read are the risk: autocast's and ``logits.float()``'s
widening casts, an LM head's matrix multiply (logits as wide as the vocabulary), factory
ops. Each cell is one warmup (a new session) of a random-weight model from a small config
(vocabulary 256 or 1024: the logits are among the step's largest activations, the floor
stays below most budgets); the budget a fraction of a probe step's activation peak. A cell is
over when its peak is above 1.05x max(budget, the step's floor). One torch thread;
``PYTHONPATH=<checkout>/src`` measures another version.

    .venv/bin/python benchmarks/warmup_budget.py --out benchmarks/results/warmup_budget.json
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hyperpar.bench.headlines import write
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20
MODELS = ("gpt2", "llama")
FRACTIONS = (0.3, 0.4, 0.5, 0.7)
VOCABS = (256, 1024)


def _build(name: str, vocab: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=0))


def _step(model: torch.nn.Module, ids: torch.Tensor, session: OffloadSession, autocast: bool) -> None:
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with session:
        with cast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    model.zero_grad(set_to_none=True)


def measure(name: str, vocab: int, autocast: bool, fraction: float) -> dict[str, Any]:
    model = _build(name, vocab)
    ids = torch.randint(0, vocab, (2, 128), generator=torch.Generator().manual_seed(0))
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    _step(model, ids, probe, autocast)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * fraction)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    _step(model, ids, session, autocast)
    report = session.last_report
    assert report is not None and report.phase == "warmup"
    floor = report.min_feasible_budget_bytes or 0
    ratio = report.peak_resident_bytes / max(budget, floor)
    return {"model": name, "vocab": vocab, "autocast": autocast, "fraction": fraction, "budget_bytes": budget,
            "floor_bytes": floor, "peak_bytes": report.peak_resident_bytes,
            "peak_over_budget": round(ratio, 3),
            "over": ratio > 1.05, "overshoot_op": report.overshoot_op, "bytes_d2h": report.bytes_d2h}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: gpt2,llama")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                        help="budgets as fractions of the probe step's peak, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = provenance()
    import logging

    logging.getLogger("hyperpar").setLevel(logging.ERROR)  # the floor warnings of tight cells
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    fractions = [float(f) for f in args.fractions.split(",") if f]
    cells = [(m, v, a, f) for m in models for v in VOCABS for a in (False, True) for f in fractions]
    rows = [measure(*cell) for cell in tqdm(cells, desc="warmups", file=sys.stderr)]
    for row in rows:
        print(f"{row['model']:6} vocab {row['vocab']:5} autocast={row['autocast']!s:5} "
              f"budget {row['fraction']:.1f}: "
              f"peak/max(budget, floor) {row['peak_over_budget']:.2f}{'  OVER' if row['over'] else ''}")
    print(f"over 1.05x: {sum(r['over'] for r in rows)} of {len(rows)}")
    if args.out is not None:
        write("warmup_budget", args.out, {
            "benchmark": "warmup_budget", "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__, "machine": platform.platform(), "threads": 1,
            "cells": rows}, started)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
