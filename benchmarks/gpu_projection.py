"""Projected H100 step of HF Llama layers at 1B-like and 8B-like shapes: plain vs the session.

Each shape is one LlamaForCausalLM decoder layer (random weights from a LlamaConfig, bf16, no
download) with a 32000-token vocabulary, traced for one forward + backward step by an
OffloadSession on this CPU. The trace's shapes give each op's FLOPs and bytes; the projection
(``hyperpar.offload.projection``) puts them on the device model and the host costs per op
(CPU-measured defaults unless given) and plans the replay at ``--budget-fraction`` of the
trace's activation peak. Sequence lengths are below 2048 so the CPU trace takes seconds; the
projection is of the traced length, not scaled.

    .venv/bin/python benchmarks/gpu_projection.py --out benchmarks/results/gpu_projection.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hyperpar.bench import headlines
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.projection import HostCosts, Projection, get_device, project

log = logging.getLogger("gpu_projection")
# name -> (hidden, intermediate, heads, kv heads, traced sequence length)
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "llama_1b_like": (2048, 5632, 16, 16, 1024),
    "llama_8b_like": (4096, 14336, 32, 8, 512),
    "tiny": (256, 704, 4, 4, 128),  # for the documented-commands test, not in the default run
}
DEFAULT_SHAPES = ("llama_1b_like", "llama_8b_like")
VOCAB = 32000


def trace_llama(hidden: int, inter: int, heads: int, kv_heads: int,
                seq: int) -> tuple[ActivationTrace, float]:
    """One traced step of a one-layer model; also the seconds it took."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=VOCAB,
                      max_position_embeddings=max(seq, 2048))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    idx = torch.randint(0, VOCAB, (1, seq))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, device="cpu"))
    started = time.perf_counter()
    with session:
        model(input_ids=idx, labels=idx).loss.backward()
    trace = session.trace
    assert trace is not None
    return trace, time.perf_counter() - started


def summary(proj: Projection) -> dict[str, Any]:
    paths = {name: {"step_ms": p.step_us / 1e3, "host_ms": p.host_us / 1e3,
                    "copy_wait_ms": p.copy_wait_us / 1e3,
                    "device_busy_ms": p.device_busy_us / 1e3, "launch_bound_ops": p.launch_bound_ops,
                    "launch_bound_kernels": p.launch_bound_kernels}
             for name, p in (("plain", proj.plain), ("warmup", proj.warmup), ("replay", proj.replay))}
    return {"ops": proj.num_ops, "kernels": proj.kernels, "tflop": proj.costs.total_flops / 1e12,
            "hbm_gb": proj.costs.total_bytes / 1e9, "flops_unknown_ops": proj.costs.flops_unknown,
            "budget_bytes": proj.budget_bytes, "peak_bytes": proj.peak_bytes,
            "deficit_bytes": proj.deficit_bytes, "d2h_bytes": proj.bytes_d2h, "h2d_bytes": proj.bytes_h2d,
            **paths}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = HostCosts()
    p.add_argument("--device", default="h100")
    p.add_argument("--budget-fraction", type=float, default=0.5, help="of the trace's activation peak")
    p.add_argument("--host-us-plain", type=float, default=defaults.plain_us)
    p.add_argument("--host-us-replay", type=float, default=defaults.replay_us)
    p.add_argument("--host-us-warmup", type=float, default=defaults.warmup_us)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(SHAPES))
    p.add_argument("--out", default="benchmarks/results/gpu_projection.json")
    args = p.parse_args(argv)
    if not 0 < args.budget_fraction <= 1:
        p.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    started = provenance()
    device = get_device(args.device)
    host = HostCosts(args.host_us_plain, args.host_us_replay, args.host_us_warmup)
    results: dict[str, Any] = {}
    for name in args.shapes:
        hidden, inter, heads, kv_heads, seq = SHAPES[name]
        trace, seconds = trace_llama(hidden, inter, heads, kv_heads, seq)
        budget = int(args.budget_fraction * trace.peak_bytes_without_offload())
        proj = project(trace, device, host, budget)
        results[name] = {"hidden": hidden, "intermediate": inter, "heads": heads, "kv_heads": kv_heads,
                         "layers": 1, "vocab": VOCAB, "seq": seq, "batch": 1, "dtype": "bfloat16",
                         "trace_seconds": seconds, **summary(proj)}
        r = results[name]
        log.info("%s (seq %d): %d ops, %.3f TFLOP; plain %.2f ms, warmup %.2f ms, "
                 "replay %.2f ms at %.0f MiB; %d/%d kernels launch-bound", name, seq, r["ops"], r["tflop"],
                 r["plain"]["step_ms"],
                 r["warmup"]["step_ms"], r["replay"]["step_ms"], budget / 2**20,
                 r["plain"]["launch_bound_kernels"], r["kernels"])
    doc = {"benchmark": "gpu_projection", "device": asdict(device), "host_costs_us": asdict(host),
           "host_costs_source": "CPU-measured defaults" if host == HostCosts() else "given",
           "budget_fraction": args.budget_fraction, "shapes": results}
    headlines.write("gpu_projection", Path(args.out), doc, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
