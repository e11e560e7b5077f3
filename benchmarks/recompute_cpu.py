"""Recompute beside offload on this CPU: HF families with dropout on, at a tight budget.

Per family (random weights from a config, dropout on, one torch thread), in one process and
interleaved round by round, steps of: plain PyTorch; full checkpointing per layer (HF's
``gradient_checkpointing_enable``, plain PyTorch); the session with offload only; and the
session with ``recompute="auto"``, planned here (``plan_for`` unset) and for ``"h100"``; and the
session with ``recompute="layers"`` (every layer rebuilt, the rest offloaded). Each
step is seeded alike (the same dropout masks) and its gradients are compared with plain's bit
for bit; each session step's peak with its budget (``--fraction`` of the movable activation
peak plus the kept bytes). Step cost is process CPU time, the median of the rounds after the
first few (warmup, the checked replay, the choice and its retrace).

    .venv/bin/python benchmarks/recompute_cpu.py --out benchmarks/results/recompute_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hyperpar.bench import headlines
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession

Builder = Callable[[], tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]]


def _llama() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=4, vocab_size=1024, attention_dropout=0.1, use_cache=False)
    ids = torch.randint(0, 1024, (2, 256), generator=torch.Generator().manual_seed(1))
    return LlamaForCausalLM(cfg), lambda m: m(input_ids=ids, labels=ids).loss


def _gpt2() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=1024, n_positions=256, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    ids = torch.randint(0, 1024, (2, 256), generator=torch.Generator().manual_seed(1))
    return GPT2LMHeadModel(cfg), lambda m: m(input_ids=ids, labels=ids).loss


def _mixtral() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=4, vocab_size=1024, num_local_experts=4, num_experts_per_tok=2,
                        attention_dropout=0.1, use_cache=False)
    ids = torch.randint(0, 1024, (2, 256), generator=torch.Generator().manual_seed(1))
    return MixtralForCausalLM(cfg), lambda m: m(input_ids=ids, labels=ids).loss


FAMILIES: dict[str, Builder] = {"hf-llama": _llama, "hf-gpt2": _gpt2, "hf-mixtral": _mixtral}


class Runner:
    """One strategy: its model copy, its session (None: plain PyTorch) and its measurements."""

    def __init__(self, name: str, model: torch.nn.Module, session: OffloadSession | None) -> None:
        self.name, self.model, self.session = name, model, session
        self.cpu_s: list[float] = []
        self.bitwise = True
        self.within_budget = True
        self.paths: list[str] = []
        self.reports: list[dict[str, Any]] = []

    def step(self, loss: Callable[[torch.nn.Module], torch.Tensor], seed: int) -> list[torch.Tensor]:
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        started = time.process_time()
        if self.session is None:
            loss(self.model).backward()
        else:
            with self.session:
                loss(self.model).backward()
        self.cpu_s.append(time.process_time() - started)
        if self.session is not None:
            r = self.session.last_report
            assert r is not None
            self.within_budget &= r.peak_resident_bytes <= r.budget_bytes
            self.paths.append("W" if r.phase == "warmup" else {"checked": "C", "fast": "F"}.get(
                r.replay_path or "", "B"))
            self.reports.append({"peak": r.peak_resident_bytes, "budget": r.budget_bytes, "d2h": r.bytes_d2h,
                                 "recomputed": r.bytes_recomputed})
        return [p.grad for p in self.model.parameters() if p.grad is not None]


def family_rows(name: str, build: Builder, fraction: float, rounds: int, settle: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base, loss = build()
    base.train()

    def copy_of() -> torch.nn.Module:
        return copy.deepcopy(base)

    ac = copy_of()
    ac.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runners = [Runner("plain", copy_of(), None), Runner("full_checkpointing", ac, None)]
    for label, config in (("offload_only", {"recompute": "off"}), ("mixed", {"recompute": "auto"}),
                          ("mixed_h100", {"recompute": "auto", "plan_for": "h100"}),
                          ("offloaded_checkpointing", {"recompute": "layers"})):
        session = OffloadSession(OffloadConfig(max_resident_fraction=fraction, **config))
        runners.append(Runner(label, copy_of(), session))
    for seed in range(rounds):
        grads = None
        for runner in runners:
            got = runner.step(loss, seed)
            if grads is None:
                grads = [g.clone() for g in got]
            else:
                runner.bitwise &= len(got) == len(grads) and all(torch.equal(a, b) for a, b in zip(
                    got, grads, strict=True))
    plain = statistics.median(runners[0].cpu_s[settle:])
    out: dict[str, Any] = {"fraction": fraction, "rounds": rounds, "settle": settle, "strategies": {}}
    for r in runners:
        cpu = statistics.median(r.cpu_s[settle:])
        out["strategies"][r.name] = {"cpu_ms": 1e3 * cpu, "over_plain": cpu / plain, "bitwise": r.bitwise,
                                     "within_budget": r.within_budget, "paths": "".join(r.paths),
                                     "last_report": r.reports[-1] if r.reports else None}
    return out


def _rebuilt(report: dict[str, Any] | None) -> str:
    return f" rebuilt {report['recomputed'] / 2**20:.1f} MiB" if report and report["recomputed"] else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--settle", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/recompute_cpu.json")
    args = p.parse_args(argv)
    if not 0 < args.fraction <= 1:
        p.error(f"--fraction must be in (0, 1], got {args.fraction}")
    if not 0 <= args.settle < args.rounds:
        p.error(f"--settle must be in [0, --rounds), got {args.settle} with --rounds {args.rounds}")
    torch.set_num_threads(1)  # bitwise against plain needs one thread here
    started = provenance()
    results = {}
    for name in tqdm(args.families, desc="families", file=sys.stderr):
        results[name] = family_rows(name, FAMILIES[name], args.fraction, args.rounds, args.settle)
    doc = {"benchmark": "recompute_cpu", "families": results, "threads": 1}
    headlines.write("recompute_cpu", Path(args.out), doc, started)
    print(f"CPU time per step over plain at {args.fraction:.0%} of the movable activation peak "
          f"(median of rounds {args.settle}..{args.rounds - 1}; paths W warmup, C checked, F fast):")
    for name, r in results.items():
        cells = "  ".join(f"{k} {v['over_plain']:.2f}x{'' if v['bitwise'] else ' NOT BITWISE'}"
                          f"{_rebuilt(v['last_report'])}"
                          f"{'' if v['within_budget'] else ' OVER BUDGET'}"
                          f"{' ' + v['paths'] if v['paths'] else ''}" for k, v in r["strategies"].items())
        print(f"  {name}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
