"""Host (CPU) cost of a session step over a plain step, on host-bound steps (issue 31).

Four steps whose ops do almost no work, so the per-op cost of interception is what a step
costs: HF Llama (hidden 64, 4 layers, 2 x 64 tokens), a chain of ``tanh(h * w + c)`` on
small tensors (~27k ops), HF GPT-2 and HF Mixtral at a similar size; random weights built
from configs, nothing downloaded. A first session at a huge budget measures the activation
peak; replay runs at 100 %, 50 % and 20 % of it, and warmup (the first step of a fresh
session, planning included) at 50 %. Every figure is CPU time (``time.process_time``, one
torch thread) of a session step over the plain step timed just before it (plain, variant,
plain, variant, ...), as median [min-max] over the repetitions.

``--mechanisms`` instead compares what a faster replay could be built on, per step over
plain: a do-nothing TorchDispatchMode, identity ``saved_tensors_hooks``, hooks recording
and checking a fingerprint of each saved tensor, identity hooks plus a prehook on every
node whose output is saved, and ``torch.autograd.graph.save_on_cpu``. ``--profile DIR``
writes cProfile text of the HF Llama warmup and replay at 50 %.

    .venv/bin/python benchmarks/host_cost.py --out benchmarks/results/host_cost.json
    .venv/bin/python benchmarks/host_cost.py --mechanisms --out benchmarks/results/host_cost_mechanisms.json
    .venv/bin/python benchmarks/host_cost.py --profile benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyperpar.bench import headlines
from hyperpar.bench.offload import PassThrough  # the do-nothing dispatch mode
from hyperpar.bench.result_file import provenance
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20
WORKLOADS = ("hf-llama", "tiny-ops", "hf-gpt2", "hf-mixtral", "hf-t5")
BUDGETS = (1.0, 0.5, 0.2)
FAST_FLOOR = "replay_fastfloor"  # replay at 1.05x the fast-path floor
Ctx = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass
class Workload:
    """One step to time: ``run(ctx)`` does fwd+bwd inside the context ``ctx`` makes."""

    name: str
    run: Callable[[Ctx | None], None]


def _hf_model(name: str, layers: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "hf-llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    if name == "hf-gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=layers, n_head=4, n_positions=256))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256))


def build(name: str, quick: bool, tiny_layers: int) -> Workload:
    """The step ``name`` at full size, or a smaller one for ``quick``."""
    if name == "tiny-ops":
        g = torch.Generator().manual_seed(0)
        layers = 60 if quick else tiny_layers
        h0 = torch.randn(8, 16, generator=g)
        ws = [torch.randn(16, generator=g).requires_grad_() for _ in range(layers)]
        cs = [torch.randn(16, generator=g).requires_grad_() for _ in range(layers)]

        def tiny(ctx: Ctx | None) -> None:
            with ctx() if ctx is not None else contextlib.nullcontext():
                h = h0
                for w, c in zip(ws, cs, strict=True):
                    h = torch.tanh(h * w + c)
                h.sum().backward()
            for p in ws + cs:
                p.grad = None

        return Workload(name, tiny)
    if name == "hf-t5":
        return _t5(quick)
    model = _hf_model(name, 1 if quick else 4)
    ids = torch.randint(0, 256, (2, 16 if quick else 64), generator=torch.Generator().manual_seed(1))

    def hf(ctx: Ctx | None) -> None:
        model.zero_grad(set_to_none=True)
        with ctx() if ctx is not None else contextlib.nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()

    return Workload(name, hf)


def _t5(quick: bool) -> Workload:
    """An encoder-decoder: HF T5, two layers each side (one with ``quick``)."""
    import transformers

    torch.manual_seed(0)
    layers = 1 if quick else 2
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_decoder_layers=layers,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.randint(1, 256, (2, 16 if quick else 64), generator=torch.Generator().manual_seed(1))

    def run(ctx: Ctx | None) -> None:
        model.zero_grad(set_to_none=True)
        with ctx() if ctx is not None else contextlib.nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()

    return Workload("hf-t5", run)


def _fast_floor(w: Workload, peak: int) -> int | None:
    """The fast-path floor a session at half the peak reports from its checked replay."""
    half = _session(peak * 0.5)
    for _ in range(2):
        w.run(_fixed(half))
    return None if half.last_report is None else half.last_report.fast_path_floor_bytes


def _cpu(w: Workload, ctx: Ctx | None) -> float:
    """CPU seconds of one step. No garbage collection between steps, as in a training loop:
    a full collection before each step (this benchmark's way until 2026-12-06) made both the
    plain and the session step ~2 ms slower on HF Llama, which diluted every ratio (fast
    replay at 50 %: 1.35x with it, 1.43x without), and hid the cost of a session's garbage
    that only the collector frees."""
    t0 = time.process_time()
    w.run(ctx)
    return time.process_time() - t0


def _session(budget_bytes: float) -> OffloadSession:
    return OffloadSession(OffloadConfig(max_resident_activation_mb=budget_bytes / MIB, device="cpu"))


def _fixed(session: OffloadSession) -> Ctx:
    return lambda: session


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def _interleaved(w: Workload, variants: dict[str, Ctx],
                 reps: int) -> tuple[list[float], dict[str, list[float]]]:
    """Plain, variant, plain, variant...; each variant's step over the plain step just before it."""
    plain: list[float] = []
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            p = _cpu(w, None)
            plain.append(p)
            ratios[name].append(_cpu(w, variants[name]) / p)
    return plain, ratios


def probe(w: Workload) -> tuple[int, int]:
    """(ops, activation peak in bytes) from a session at a huge budget; also warms imports."""
    session = _session(float(1 << 40))
    w.run(_fixed(session))
    report = session.last_report
    assert report is not None and report.peak_resident_bytes > 0, w.name
    return report.op_count, report.peak_resident_bytes


def measure(w: Workload, reps: int, warmup_reps: int) -> dict[str, Any]:
    """Replay at each budget and warmup at 50 %, over plain, for one step."""
    ops, peak = probe(w)
    sessions = {f"replay_{round(f * 100)}": _session(peak * f) for f in BUDGETS}
    fast_floor = _fast_floor(w, peak)
    if fast_floor is not None:  # 5 % above it: the tightest budget the fast path is promised at
        sessions[FAST_FLOOR] = _session(fast_floor * 1.05)
    for session in sessions.values():
        for step in range(12):  # warmup, then replays until the fast path (or 12 steps): the
            w.run(_fixed(session))  # timed steps are steady replays
            if step >= 2 and session.last_report is not None and session.last_report.replay_path == "fast":
                break
    plain, ratios = _interleaved(w, {k: _fixed(s) for k, s in sessions.items()}, reps)
    floors = {}
    for key, session in sessions.items():
        report = session.last_report
        assert report is not None and report.phase == "replay" and report.diverged_at is None, (w.name, key)
        floors[key] = {"budget_bytes": report.budget_bytes, "peak_resident_bytes": report.peak_resident_bytes,
                       "min_feasible_budget_bytes": report.min_feasible_budget_bytes,
                       "bytes_d2h": report.bytes_d2h, "replay_path": report.replay_path,
                       "fast_refusal": getattr(session._running, "fast_refusal", None)}  # older: none
    warm_plain, warm = [], []
    for _ in range(warmup_reps):  # each warmup needs a fresh session
        p = _cpu(w, None)
        fresh = _session(peak * 0.5)
        warm_plain.append(p)
        warm.append(_cpu(w, _fixed(fresh)) / p)
        assert fresh.last_report is not None and fresh.last_report.phase == "warmup", w.name
    plain += warm_plain
    return {"ops": ops, "peak_bytes": peak, "fast_path_floor_bytes": fast_floor,
            "plain_cpu_ms": _spread([p * 1e3 for p in plain]),
           "plain_us_per_op": statistics.median(plain) * 1e6 / ops, "replay_reports": floors,
           "over_plain": {**{k: _spread(v) for k, v in ratios.items()}, "warmup_50": _spread(warm)}}


def _noop(*_: Any) -> None:
    return None


class Fingerprints:
    """Saved-tensor hooks: pack records (shape, dtype, storage, version, grad_fn), unpack checks it.

    The storage is identified by ``untyped_storage()._cdata`` (the StorageImpl address): the
    Python storage object is a new wrapper on each call, so its ``id`` would not be stable.
    """

    def __init__(self) -> None:
        self.saved: list[tuple[torch.Size, torch.dtype, int, int, Any]] = []

    def pack(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Record the fingerprint, keep the tensor."""
        self.saved.append((t.shape, t.dtype, t.untyped_storage()._cdata, t._version, t.grad_fn))
        return len(self.saved) - 1, t

    def unpack(self, packed: tuple[int, torch.Tensor]) -> torch.Tensor:
        """Check the tensor still matches what pack saw."""
        i, t = packed
        shape, dtype, storage, version, _ = self.saved[i]
        if (t._version != version or t.shape != shape or t.dtype != dtype
                or t.untyped_storage()._cdata != storage):
            raise RuntimeError(f"saved tensor {i} changed between pack and unpack")
        return t

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        self.saved = []
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class Prehooks:
    """Identity saved-tensor hooks; pack registers a no-op prehook on the saved tensor's grad_fn, once."""

    def __init__(self) -> None:
        self.seen: set[Any] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Hook the node that made ``t`` (if any, and not hooked yet)."""
        fn = t.grad_fn
        if fn is not None and fn not in self.seen:
            self.seen.add(fn)
            fn.register_prehook(_noop)
        return t

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        self.seen = set()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


MECHANISMS: dict[str, Ctx] = {
    "dispatch_mode_noop": PassThrough,
    "saved_tensors_hooks_identity": lambda: torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
    "saved_tensors_hooks_fingerprint": Fingerprints(),
    "saved_tensors_hooks_identity_prehooks": Prehooks(),
    "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
}


def measure_mechanisms(w: Workload, reps: int) -> dict[str, Any]:
    """Each mechanism's step over plain, interleaved."""
    ops, _ = probe(w)
    for ctx in MECHANISMS.values():
        w.run(ctx)
    plain, ratios = _interleaved(w, MECHANISMS, reps)
    return {"ops": ops, "plain_cpu_ms": _spread([p * 1e3 for p in plain]),
            "plain_us_per_op": statistics.median(plain) * 1e6 / ops,
            "over_plain": {k: _spread(v) for k, v in ratios.items()}}


def _cell(s: dict[str, Any]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def table(results: dict[str, dict[str, Any]], columns: list[str]) -> str:
    """The markdown table: one row per step, plain µs/op then each ratio column."""
    heads = [c.replace("_", " ") + (" %" if c[-1].isdigit() else "") for c in columns]
    lines = ["| step | ops | plain host µs/op | " + " | ".join(heads) + " |",
             "|---" * (len(columns) + 3) + "|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['ops']:,} | {r['plain_us_per_op']:.2f} | "
                     + " | ".join(_cell(r["over_plain"][c]) for c in columns) + " |")
    return "\n".join(lines)


def profile(out_dir: Path, quick: bool, steps: int = 10) -> list[Path]:
    """cProfile of ``steps`` HF Llama warmups (each a fresh session) and replays at 50 %, as text."""
    w = build("hf-llama", quick, 0)
    ops, peak = probe(w)
    written = []
    prov = provenance()  # before the first file is written (which makes the tree dirty)
    for phase in ("warmup", "replay"):
        kept = _session(peak * 0.5)
        for step in range(12):  # replays until the fast path: the profile is of steady steps
            w.run(_fixed(kept))
            if step >= 2 and kept.last_report is not None and kept.last_report.replay_path == "fast":
                break
        sessions = [_session(peak * 0.5) if phase == "warmup" else kept for _ in range(steps)]
        prof = cProfile.Profile()
        gc.collect()
        for session in sessions:
            prof.enable()
            w.run(_fixed(session))
            prof.disable()
            assert session.last_report is not None and session.last_report.phase == phase
        buf = io.StringIO()
        fresh = " (a fresh session each)" if phase == "warmup" else ""
        report = kept.last_report
        paths = "" if phase == "warmup" or report is None else f" ({report.replay_path})"
        buf.write(f"# HF Llama (hidden 64, 4 layers, 2 x 64 tokens, {ops} ops), {phase}{paths} at 50 % of "
                  f"the peak, {steps} steps{fresh}\n# commit {prov['commit']} dirty={prov['dirty']} "
                  f"torch {prov['torch']} load {prov['load_average']['start']}\n"
                  f"# command: {prov['command']}\n")
        for key in ("tottime", "cumulative"):
            buf.write(f"\n## top 25 by {key}\n")
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(25)
        path = out_dir / f"host_cost_profile_{phase}.txt"
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(buf.getvalue().replace(str(Path.cwd()) + "/", ""))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small steps, 1 repetition (smoke test)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed replay steps per variant (default 9; quick 1)")
    parser.add_argument("--warmup-reps", type=int, default=None,
                        help="fresh sessions timed (default 5; quick 1)")
    parser.add_argument("--tiny-layers", type=int, default=1930,
                        help="tanh(h * w + c) layers, ~14 ops each (default 1930: ~27k ops)")
    parser.add_argument("--steps", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--mechanisms", action="store_true",
                        help="compare mechanisms instead of session phases")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="write cProfile text of HF Llama warmup and replay at 50 %% into DIR, then stop")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON (default hyperpar-bench/host_cost.json or host_cost_mechanisms.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = provenance(["benchmarks/host_cost.py", *(sys.argv[1:] if argv is None else argv)])
    if args.profile is not None:
        for path in profile(args.profile, args.quick, 2 if args.quick else 10):
            print(f"wrote {path}")
        return 0
    reps = args.reps or (1 if args.quick else 9)
    warmup_reps = args.warmup_reps or (1 if args.quick else 5)
    results: dict[str, dict[str, Any]] = {}
    for name in args.steps:
        w = build(name, args.quick, args.tiny_layers)
        results[name] = measure_mechanisms(w, reps) if args.mechanisms else measure(w, reps, warmup_reps)
        print(f"{name}: {results[name]['ops']} ops done", flush=True)
    phases = [f"replay_{round(f * 100)}" for f in BUDGETS] + [FAST_FLOOR, "warmup_50"]
    columns = list(MECHANISMS) if args.mechanisms else phases
    text = table(results, columns)
    print(text)
    default = "host_cost_mechanisms.json" if args.mechanisms else "host_cost.json"
    out = args.out or Path("hyperpar-bench") / default
    doc = {"what": "mechanisms" if args.mechanisms else "session phases", "quick": args.quick, "reps": reps,
           "warmup_reps": None if args.mechanisms else warmup_reps, "tiny_layers": args.tiny_layers,
           "steps": results, "table": text}
    headlines.write("host_cost_mechanisms" if args.mechanisms else "host_cost", out, doc, started)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
