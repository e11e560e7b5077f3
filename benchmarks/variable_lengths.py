"""Random sequence lengths with an OffloadSession: warmups, budget, host memory, step time.

A small HF Llama (random weights, from a config) trains ``--steps`` steps whose sequence
length is drawn from 32..256 every step, at 40 % of the longest step's activation peak.
Interleaved in the same process, the same model trains at a fixed length (the mean, 144)
in a session of its own, and both without a session, so the time figures are ratios
measured side by side: CPU seconds per token, offload over plain, variable over fixed.

    .venv/bin/python benchmarks/variable_lengths.py --out benchmarks/results/variable_lengths.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hyperpar.bench.headlines import write
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _step(model: torch.nn.Module, ids: torch.Tensor, session: OffloadSession | None) -> float:
    t0 = time.process_time()
    if session is None:
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        with session:
            model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - t0


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("hyperpar-bench/variable_lengths.json"))
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error(f"--steps must be at least 4, got {args.steps}")
    started = provenance(["python", "benchmarks/variable_lengths.py", *(argv or sys.argv[1:])])
    torch.set_num_threads(1)
    model = _llama()
    gen = torch.Generator().manual_seed(0)
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=float(1 << 20)))
    _step(model, torch.randint(0, 256, (2, 256), generator=gen), probe)
    assert probe.last_report is not None
    budget = int(probe.last_report.peak_resident_bytes * 0.4)
    variable = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    fixed = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    rng = random.Random(0)
    lengths = [rng.randint(32, 256) for _ in range(args.steps)]
    fixed_len = 144
    cpu = {"variable_offload": 0.0, "variable_plain": 0.0, "fixed_offload": 0.0, "fixed_plain": 0.0}
    tokens = {"variable": 0, "fixed": 0}
    warmups = diverged = over = 0
    worst = 0.0
    paths: dict[str, int] = {}  # the random-length session's steps by replay path
    sequence: list[str] = []  # each step's path, by its first letter (W, C, F, B: fallback)
    marks: dict[int, dict[str, float]] = {}
    for step, length in enumerate(tqdm(lengths, desc="steps", file=sys.stderr)):
        ids = torch.randint(0, 256, (2, length), generator=gen)
        same = torch.randint(0, 256, (2, fixed_len), generator=gen)
        cpu["variable_offload"] += _step(model, ids, variable)
        cpu["variable_plain"] += _step(model, ids, None)
        cpu["fixed_offload"] += _step(model, same, fixed)
        cpu["fixed_plain"] += _step(model, same, None)
        tokens["variable"] += ids.numel()
        tokens["fixed"] += same.numel()
        report = variable.last_report
        assert report is not None
        warmups += report.phase == "warmup"
        path = report.replay_path or report.phase
        paths[path] = paths.get(path, 0) + 1
        sequence.append("B" if path == "fallback" else path[0].upper())
        diverged += report.diverged_at is not None
        worst = max(worst, report.peak_resident_bytes / budget)
        over += report.peak_resident_bytes > budget * 1.05
        if step + 1 in (50, 150, args.steps):
            marks[step + 1] = {"held_mib": variable.held_bytes() / MIB,
                               "host_allocations": variable.host_allocations(), "max_rss_mib": _rss_mib()}
    later = sequence[len(sequence) // 10:]  # after the first few lengths
    per_token = {k: v / tokens[k.split("_")[0]] * 1e6 for k, v in cpu.items()}  # CPU µs per token
    doc: dict[str, Any] = {
        "command": "python benchmarks/variable_lengths.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)",
        "torch": torch.__version__,
        "load_average": list(map(float, open("/proc/loadavg").read().split()[:3])),
        "steps": args.steps, "lengths": "uniform 32..256, batch 2", "budget_bytes": budget,
        "warmups": warmups, "diverged_steps": diverged, "steps_over_1_05_budget": over,
        "max_peak_over_budget": worst, "replay_paths": paths,
        "paths_by_step": "".join(sequence), "lengths_by_step": lengths,
        "fast_after_first_tenth": later.count("F") / len(later),
        "plans": {str(k): len(s.sizes) for k, s in variable._structures.items()},
        "at_step": marks,
        "cpu_us_per_token": per_token,
        "offload_over_plain": {"variable": cpu["variable_offload"] / cpu["variable_plain"],
                               "fixed": cpu["fixed_offload"] / cpu["fixed_plain"]},
        "variable_over_fixed_per_token_in_session":
            per_token["variable_offload"] / per_token["fixed_offload"],
    }
    write("variable_lengths", args.out, doc, started)
    print(json.dumps({k: doc[k] for k in ("warmups", "diverged_steps", "steps_over_1_05_budget",
                                          "max_peak_over_budget", "replay_paths", "fast_after_first_tenth",
                                          "at_step",
                                          "offload_over_plain",
                                          "variable_over_fixed_per_token_in_session")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
