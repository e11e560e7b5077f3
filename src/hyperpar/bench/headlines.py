"""The headline figures of each result file, derived from the file's own data.

One function per result (keyed by the file's stem): a benchmark calls it when it writes,
and the conversion of files written before the headline format called it once, so a
figure is computed in one place whichever way the file was made.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyperpar.bench.result_file import Figure, figure, write_result

MIB = 2 ** 20


def _med(d: dict[str, float]) -> tuple[float, tuple[float, float]]:
    return d["median"], (d["min"], d["max"])


def moe(doc: dict[str, Any]) -> list[Figure]:
    """MoeExperts vs torchtitan per shape and dtype, memory, grouped GEMM, stacked layers."""
    page = "docs/moe.md#performance-hyperpar-bench-moe"
    figs: list[Figure] = []
    for shape, label in (("fine_grained", "fine-grained (32 experts, top-4)"),
                         ("coarse", "coarse (8 experts, top-2)")):
        cells = doc["summary"].get(shape)
        if cells is None:  # (a --quick run measures one shape)
            continue
        if "moe_over_torchtitan" in cells.get("bfloat16", {}):  # (a --quick run may have no peer)
            bf = cells["bfloat16"]
            v, s = _med(bf["moe_over_torchtitan"])
            figs.append(figure(f"{shape}_bf16_over_torchtitan", v, "x",
                               f"MoE fwd+bwd {label}, bf16, 2 gloo ranks: CPU time / torchtitan",
                               page, spread=s, goal=f"<= {bf['goal_moe_over_torchtitan']}"))
            mem = bf["memory"]
            figs.append(figure(f"{shape}_bf16_memory_mib", mem["MoeExperts"]["total_bytes"] / MIB, "MiB",
                               f"MoE {label}, bf16: memory (rise + kept workspace)", page,
                               goal=f"<= torchtitan's {mem['torchtitan']['total_bytes'] / MIB:.1f} MiB"))
        if "float32" in cells:
            fp = cells["float32"]
            if "bf16_gemm_opt_in_over_torchtitan" in fp:
                v, s = _med(fp["bf16_gemm_opt_in_over_torchtitan"])
                figs.append(figure(f"{shape}_fp32_optin_over_torchtitan", v, "x",
                                   f"MoE {label}, fp32 with opt-in bf16 GEMMs: CPU time / torchtitan",
                                   page, spread=s, goal=f"<= {fp['goal_moe_over_torchtitan']}"))
            if "moe_over_torchtitan" not in fp:  # (a --quick run without the peer)
                continue
            v, s = _med(fp["moe_over_torchtitan"])
            figs.append(figure(f"{shape}_fp32_strict_over_torchtitan", v, "x",
                               f"MoE {label}, strict fp32 GEMMs (torchtitan: bf16): CPU time / torchtitan",
                               page, spread=s))
    for dtype, cell in doc.get("grouped_mm_vs_loop", {}).items():
        figs.append(figure(f"grouped_over_loop_{dtype}", cell["grouped_over_loop"], "x",
                           f"grouped expert GEMM / per-expert loop, {dtype}", page))
    for shape, st in doc.get("stack", {}).items():
        if "moe_over_torchtitan" not in st:  # (a --quick run without the peer)
            continue
        figs.append(figure(f"{shape}_{st['layers']}_layers_over_torchtitan", st["moe_over_torchtitan"], "x",
                           f"{st['layers']} serial {st['dtype']} MoE layers sharing one workspace ({shape}): "
                           f"CPU time / torchtitan", page))
    return figs


def offload(doc: dict[str, Any]) -> list[Figure]:
    """Offload step time over plain at the peak and at half of it, and the interception floor."""
    page = "docs/architecture.md"
    return [
        figure("replay_at_peak_over_plain", doc["replay_at_peak"]["ratio_to_plain"], "x",
               "GPT small batch 16, budget = peak: session step / plain step (wall)", page),
        figure("replay_at_50_over_plain", doc["replay_at_50"]["ratio_to_plain"], "x",
               "GPT small batch 16, budget = 50 % of peak: session step / plain step (wall)", page),
        figure("passthrough_over_plain", doc["passthrough"]["ratio_to_plain"], "x",
               "same model under a do-nothing TorchDispatchMode / plain (the interception floor)", page),
    ]


def planner(doc: dict[str, Any]) -> list[Figure]:
    """TimedPlanner's exposed wait against GreedyPlanner and the lower bound, and planning time."""
    s, page = doc["summary"], "docs/planner.md"
    return [
        figure("median_wait_timed_over_greedy", s["median_wait_timed_over_greedy"], "x",
               "exposed transfer wait, timed / greedy planner, median over 4 models x 3 budgets", page,
               goal=f"<= {s['goal_median_wait_timed_over_greedy']}"),
        figure("worst_timed_wait_over_lower_bound", s["worst_timed_wait_over_lower_bound"], "x",
               "timed planner's wait / lower bound, worst case", page,
               goal=f"<= {s['goal_timed_wait_over_lower_bound']}"),
        figure("synthetic_plan_cpu_s_timed", s["synthetic_plan_cpu_seconds"]["timed"], "s",
               "timed planner: CPU time to plan a synthetic 200,000-op trace", page,
               goal=f"< {s['goal_synthetic_plan_seconds']} s"),
    ]


def variable_lengths(doc: dict[str, Any]) -> list[Figure]:
    """Warmups, budget, host memory and CPU cost of 300 random-length steps."""
    marks = doc["at_step"]  # int keys as written, str keys once read back from JSON
    page, last = "docs/variable_shapes.md#measured", marks.get(str(doc["steps"])) or marks[doc["steps"]]
    return [
        figure("warmups", doc["warmups"], "warmups",
               f"HF Llama, {doc['steps']} steps of random length 32-256: warmups (traced steps)", page,
               goal="1"),
        figure("max_peak_over_budget", doc["max_peak_over_budget"], "x",
               "same run: worst step peak / budget", page, goal="<= 1.05"),
        *([figure("fast_after_first_tenth", doc["fast_after_first_tenth"], "share",
                  "same run: steps on the fast path after the first tenth", page, better="higher",
                  goal=">= 0.90")]
          if "fast_after_first_tenth" in doc else []),
        figure("held_mib_last_step", last["held_mib"], "MiB",
               f"same run: host memory held by the pool at step {doc['steps']}", page),
        figure("random_over_fixed", doc["variable_over_fixed_per_token_in_session"], "x",
               "same run: CPU per token in the session, random lengths / fixed length", page),
        figure("session_over_plain", doc["offload_over_plain"]["variable"], "x",
               "same run: CPU in the session / without one (hidden 64: tiny ops)", page),
    ]


def variable_shapes_models(doc: dict[str, Any]) -> list[Figure]:
    """Five HF models with shapes changing every step: warmups, exactness, divergence, budget."""
    page, models = "docs/variable_shapes.md#other-models-batch-sizes-and-training-set-ups", doc["models"]
    diverged = sum(1 for m in models.values() for st in m["steps"]
                   if st["phase"] == "replay" and st.get("diverged_at") is not None)
    return [
        figure("warmups_max", max(m["warmups"] for m in models.values()), "warmups",
               f"{len(models)} HF models, 16 steps of random batch and length: most warmups of one model",
               page, goal="1"),
        figure("not_bitwise", sum(m["not_bitwise"] for m in models.values()), "steps",
               "same runs: steps whose loss or gradients differ from plain", page, goal="0"),
        figure("diverged_replays", diverged, "steps",
               "same runs: replayed steps that diverged from their plan (then ran correct, in budget)", page),
        figure("worst_peak_over_budget", max(m["worst_peak_over_budget_when_feasible"]
                                             for m in models.values()), "x",
               "same runs: worst step peak / a feasible budget", page, goal="<= 1.05"),
        figure("over_budget_floor_unknown", sum(len(m.get("over_budget_floor_unknown", ()))
                                                for m in models.values()), "steps",
               "same runs: steps over 1.05x the budget whose floor is unknown (fell back at their "
               "first saved tensor)", page),
    ]


def compile_in_session(doc: dict[str, Any]) -> list[Figure]:
    """torch.compile'd model in a session vs compiled without one."""
    page, v = "docs/works_with.md", doc["variants"]
    return [
        figure("session_peak_over_compiled", v["session_peak"]["cpu_ratio_to_compiled"], "x",
               "torch.compile GPT small in a session at budget = peak: CPU / compiled alone", page),
        figure("session_50_over_compiled", v["session_50"]["cpu_ratio_to_compiled"], "x",
               "same at 50 % of the peak", page),
    ]


def _worst_seconds(part: dict[str, Any]) -> float:
    return max(r["seconds"] for sc in part["scenarios"].values() for r in sc.values()
               if isinstance(r, dict) and r.get("seconds") is not None)  # None: the rank that died


def multicore_hang_paths(doc: dict[str, Any]) -> list[Figure]:
    """Time to error on every rank when one rank fails, now and before issue 14."""
    page = "docs/multicore.md"
    if "after" not in doc:  # only a "before" run written so far
        return []
    figs = [figure("worst_seconds_to_error", _worst_seconds(doc["after"]), "s",
                   "a mistake or failure on one rank: slowest time to error over ranks and paths "
                   f"(process-group timeout {doc['after']['pg_timeout_s']} s)", page)]
    if "before" in doc:
        figs.append(figure("worst_seconds_to_error_before", _worst_seconds(doc["before"]), "s",
                           "same before issue 14 (a4f59db)", page))
    return figs


def fuzz_failures(doc: dict[str, Any]) -> list[Figure]:
    """Random programs bitwise equal to plain, now and before issue 11."""
    if "after" not in doc:  # only a "before" run written so far
        return []
    page, after = "docs/reliability.md", doc["after"]
    figs = [figure("bitwise_cases", after["ok"], f"of {after['cases']}",
                   "random programs (CI's fixed cases) bitwise equal to plain", page, better="higher",
                   goal=str(after["cases"]))]
    before = doc.get("before_a4f59db")
    if before:
        figs.append(figure("bitwise_cases_before", before["ok"], f"of {before['cases']}",
                           "same before issue 11 (a4f59db)", page, better="higher"))
    return figs


def replay_instructions(doc: dict[str, Any]) -> list[Figure]:
    """Replay's CPU instructions per op over a do-nothing dispatch mode (valgrind)."""
    page, s = "docs/architecture.md", doc["stop20"]
    per_op = s["replay_over_passthrough_instructions_per_op_837_op_step"]
    return [
        figure("replay_instructions_per_op", per_op["lean (a54701a)"], "instructions",
               "replay's cost per op over a do-nothing TorchDispatchMode, tiny GPT 837 ops (valgrind)", page),
        figure("passthrough_instructions_per_op", s["passthrough_instructions_per_op_837_op_step"],
               "instructions", "the do-nothing TorchDispatchMode itself, per op", page),
    ]


def replay_overhead_cpu(doc: dict[str, Any]) -> list[Figure]:
    """Replay's CPU time per op over a do-nothing dispatch mode."""
    runs = [r["per_op_us"] for r in doc["stop20"]["runs"]["final"]]
    return [figure("replay_us_per_op", statistics.median(runs), "µs",
                   f"replay's CPU time per op over a do-nothing mode, median of {len(runs)} runs",
                   "docs/architecture.md", spread=(min(runs), max(runs)))]


def replay_overhead(doc: dict[str, Any]) -> list[Figure]:
    """One run of ``benchmarks/replay_overhead.py``: replay's CPU time per op and per step."""
    page = "docs/architecture.md"
    return [figure("replay_us_per_op", doc["replay_over_passthrough_us_per_op"], "µs",
                   "replay's CPU time per op over a do-nothing mode (slope between 2 and 8 layers)", page),
            figure("replay_us_per_step", doc["replay_over_passthrough_us_per_step"], "µs",
                   "same: the fixed part per step", page)]


def tiny_ops(doc: dict[str, Any]) -> list[Figure]:
    """A step of 301,002 tiny ops: warmup, planning and replay against plain."""
    page = "docs/architecture.md"
    return [
        figure("warmup_over_plain", doc["warmup_over_plain"], "x",
               f"a step of {doc['ops']:,} tiny ops: warmup CPU / plain", page, goal="<= 3"),
        figure("planning_cpu_s", doc["planning_cpu_s"], "s", "same: planning CPU time", page),
        figure("replay_over_plain", doc["replay_over_plain"], "x",
               f"same: replay at {doc['budget_fraction']:.0%} of the peak, CPU / plain", page),
        figure("kept_plan_bytes_per_access", doc["kept_plan_bytes_per_access"], "bytes",
               "same: memory of a kept plan per storage access", page),
    ]


def warmup_budget(doc: dict[str, Any]) -> list[Figure]:
    """Warmup steps kept under budget across models, budgets and autocast."""
    cells, page = doc["cells"], "docs/architecture.md"
    return [figure("warmup_cells_over_budget", sum(1 for c in cells if c["over"]), f"of {len(cells)}",
                   "warmup steps over their budget (models x budgets x autocast)", page, goal="0"),
            figure("warmup_worst_peak_over_budget", max(c["peak_over_budget"] for c in cells), "x",
                   "same: worst warmup peak / budget", page)]


def grown_steps(doc: dict[str, Any]) -> list[Figure]:
    """A step grown past its only plan: worst peak over max(budget, floor), first and re-planned."""
    page, rows = "docs/variable_shapes.md", doc["rows"]
    return [
        figure("first_grown_step_worst_over_target", max(r["first_at_256"] for r in rows), "x",
               f"attention-like step planned at length 96, first step at 256: worst peak / "
               f"max(budget, floor) over {len(rows)} budgets", page),
        figure("replanned_step_worst_over_target", max(r["second_at_256"] for r in rows), "x",
               "same, second step at 256 (re-planned from the first)", page),
    ]


def host_pool(doc: dict[str, Any]) -> list[Figure]:
    """Host memory the pool holds after drifting sizes, against the largest step's need."""
    page = "docs/architecture.md"
    steps = doc["pool_plain"]["steps"]
    last = steps[max(steps, key=int)]
    figs = [figure("pool_held_over_step_need", last["held_mib"] / last["max_step_need_mib"], "x",
                   "host pool alone, random sizes: bytes held / largest step's need", page),
            figure("pool_allocations", last["allocations"], "allocations",
                   "same: host allocations over the run", page)]
    if "session" in doc:
        ss = doc["session"]["steps"]
        figs.append(figure("session_held_mib", ss[max(ss, key=int)]["held_mib"], "MiB",
                           "GPT in a session, random batch and length: host memory held at the end", page))
    return figs


def _over_plain(step: str, r: dict[str, Any], col: str, what: str, page: str,
                goal: str | None = None) -> Figure:
    s = r["over_plain"][col]
    return figure(f"{step}_{col}_over_plain", s["median"], "x", what, page, spread=(s["min"], s["max"]),
                  goal=goal)


def host_cost(doc: dict[str, Any]) -> list[Figure]:
    """Issue 31's goals: replay at 50 % and warmup over plain on HF Llama and tiny ops (CPU),
    and replay at 100 % (a plan that moves nothing: the fast path)."""
    page, steps, figs = "docs/architecture.md", doc["steps"], []
    for step, replay_goal in (("hf-llama", "<= 1.3"), ("tiny-ops", "<= 1.5")):
        if step not in steps:
            continue
        for col, phase, goal in (("replay_100", "replay", None), ("replay_50", "replay", replay_goal),
                                 ("replay_fastfloor", "replay", replay_goal),
                                 ("warmup_50", "warmup", "<= 3")):
            if col not in steps[step].get("over_plain", {}):
                continue
            pct = col.rsplit("_", 1)[1]
            at = "1.05x its fast-path floor" if pct == "fastfloor" else f"{pct}% of the peak"
            what = f"{step} ({steps[step]['ops']:,} ops): {phase} at {at}, CPU / plain"
            figs.append(_over_plain(step, steps[step], col, what, page, goal))
    return figs


def host_cost_mechanisms(doc: dict[str, Any]) -> list[Figure]:
    """What each interception mechanism alone costs on HF Llama, CPU over plain."""
    r = doc["steps"].get("hf-llama")
    if r is None:
        return []
    page = "docs/architecture.md"
    return [_over_plain("hf-llama", r, k, f"hf-llama: {k.replace('_', ' ')}, CPU / plain", page)
            for k in r["over_plain"]]


def gpu_projection(doc: dict[str, Any]) -> list[Figure]:
    """Projected GPU step time of plain and replay, and the launch-bound share, per shape."""
    page, device, frac, figs = "docs/gpu_projection.md", doc["device"]["name"], doc["budget_fraction"], []
    for name, r in doc["shapes"].items():
        short = name.removeprefix("llama_").removesuffix("_like")
        what = f"{short}-like HF Llama layer, seq {r['seq']}, {device} projection"
        figs += [
            figure(f"{name}: plain step", r["plain"]["step_ms"], "ms", f"{what}: plain PyTorch", page),
            figure(f"{name}: session replay step", r["replay"]["step_ms"] / r["plain"]["step_ms"], "x",
                   f"{what}: replay at {frac:.0%} of the peak, over plain", page),
            figure(f"{name}: launch-bound kernels", 100 * r["plain"]["launch_bound_kernels"] / r["kernels"],
                   "%", f"{what}: kernels whose plain host cost exceeds their device time", page),
        ]
    return figs


def demo_step(doc: dict[str, Any]) -> list[Figure]:
    s, st = doc["steady_over_plain"], doc["settings"]
    return [figure("demo_gpt_step_over_plain", s["median"], "x",
                   f"demo GPT ({st['size']}, batch {st['batch_size']}) at {st['budget_fraction']:.0%} of its "
                   f"peak: wall step / plain, steps {doc['settle']}+", "docs/architecture.md",
                   spread=(s["min"], s["max"]))]


def fast_paths(doc: dict[str, Any]) -> list[Figure]:
    """Which step a session first runs fast, per family, at the budgets it was run at."""
    figs = []
    for family, row in doc["families"].items():
        for budget, cell in row.items():
            first = -1 if cell["first_fast_step"] is None else cell["first_fast_step"]
            at = ("5 % above its fast-path floor" if budget.startswith("fast_floor")
                  else f"{budget} of its peak")
            what = (f"{family} at {at}: the first step on the fast path (0 is the warmup; "
                    f"-1: none in {doc['steps_per_session']}), paths {cell['paths']}")
            figs.append(figure(f"{family}_{budget.rstrip('%')}_first_fast_step", first, "step", what,
                               "docs/architecture.md"))
    return figs


def whole_model_projection(doc: dict[str, Any]) -> list[Figure]:
    """Per shape on h100, host cost equal to plain's: the mixed plan at 30 % of the movable
    activation peak and full checkpointing, over plain."""
    figs, page = [], "docs/architecture.md"
    for name, r in doc["shapes"].items():
        eq = r["devices"].get("h100", {}).get("equal")
        if eq is None or "30%" not in eq["budgets"]:
            continue
        plain = eq["plain"]["step_ms"]
        what = f"whole {name} ({r['layers']} layers, seq {r['seq']}, batch {r['batch']}), h100 projection"
        mixed, ac = eq["budgets"]["30%"]["mixed"], eq["full_checkpointing"]
        figs += [
            figure(f"{name}: mixed plan at 30%", mixed["step_ms"] / plain, "x",
                   f"{what}: the mixed plan at 30% of the movable activation peak "
                   f"(reached {mixed['activation_pct']:.0f} %), over plain", page,
                   goal="<= 1.10" if name == "llama_1b_like" else None),
            figure(f"{name}: full checkpointing", ac["step_ms"] / plain, "x",
                   f"{what}: full checkpointing per layer ({ac['activation_pct']:.0f} % of the movable "
                   f"peak), over plain", page),
        ]
    return figs


def disk_store(doc: dict[str, Any]) -> list[Figure]:
    """The disk store's write and read bandwidth over the raw figure of the same disk, at the
    largest tensor size measured (and the raw figures themselves)."""
    page = "docs/architecture.md"
    raw = doc["gbps"]["raw"]
    largest = max(doc["store_over_raw"], key=lambda k: float(k.split()[0]))
    ratio = doc["store_over_raw"][largest]
    how = "O_DIRECT" if doc["direct"].get("raw") else "buffered"
    return [
        figure("raw write GB/s", raw["write_gbps"], "GB/s", f"disk, raw sequential 8 MiB writes ({how})",
               page),
        figure("raw read GB/s", raw["read_gbps"], "GB/s", f"disk, raw sequential 8 MiB reads ({how})",
               page),
        figure("store write over raw", ratio["write"], "x",
               f"DiskStore writes of {largest} tensors / raw, same disk"
               f"{'' if doc['bitwise'] else ' (NOT bitwise)'}", page, goal=">= 0.8"),
        figure("store read over raw", ratio["read"], "x",
               f"DiskStore reads of {largest} tensors / raw, same disk", page, goal=">= 0.8"),
    ]


def disk_tier(doc: dict[str, Any]) -> list[Figure]:
    """The disk tier's step against host-only offload at the same device budget, its I/O
    against the raw figure of the same disk, and the host it held against its budget."""
    page = "docs/architecture.md"
    io, mem = doc["io"], doc["host_memory"]["disk"]
    model = (f"demo GPT {doc['model']['size']} batch {doc['model']['batch_size']}, host budget "
             f"{doc['host_budget_mib']:.0f} MiB of {doc['moved_per_step_mib']:.0f} MiB moved a step"
             f"{'' if doc['bitwise'] else ' (NOT bitwise)'}")
    return [
        figure("disk tier step over host-only offload", doc["disk_over_host_only"]["median"], "x", model,
               page),
        figure("disk tier step over plain", doc["steady_over_plain"]["disk"]["median"], "x", model, page),
        *([figure("disk plan step over online policy", doc["planned_over_online"]["median"], "x",
                  f"the same tier without the plan's disk plan; "
                  f"{doc['per_step_mib']['to_disk']:.1f} vs {doc['online_per_step_mib']['to_disk']:.1f} "
                  f"MiB a step to disk", page)] if "planned_over_online" in doc else []),
        figure("disk tier writes over raw", io["write_over_raw"], "x",
               "I/O thread write bandwidth / raw 8 MiB O_DIRECT writes, same disk", page, goal=">= 0.8"),
        figure("disk tier reads over raw", io["read_over_raw"], "x",
               "I/O thread read bandwidth / raw 8 MiB O_DIRECT reads, same disk", page, goal=">= 0.8"),
        figure("disk tier peak host MiB", mem["peak_host_mib"], "MiB",
               f"most host bytes held for activations in {doc['rss_steps']} steps; host budget "
               f"{doc['host_budget_mib']:.1f} MiB", page),
    ]


def recompute_cpu(doc: dict[str, Any]) -> list[Figure]:
    """Per family at the run's budget: the mixed plan's CPU time over plain (bitwise, said)."""
    figs = []
    for name, r in doc["families"].items():
        m = r["strategies"]["mixed"]
        figs.append(figure(f"{name}: mixed over plain", m["over_plain"], "x",
                           f"{name}, dropout on, at {r['fraction']:.0%} of the movable peak: recompute=auto, "
                           f"CPU / plain ({'bitwise' if m['bitwise'] else 'NOT bitwise'})",
                           "docs/architecture.md"))
    return figs


HEADLINES: dict[str, Callable[[dict[str, Any]], list[Figure]]] = {
    "moe": moe, "offload": offload, "planner": planner, "variable_lengths": variable_lengths,
    "variable_shapes_models": variable_shapes_models, "compile": compile_in_session,
    "multicore_hang_paths": multicore_hang_paths, "fuzz_failures": fuzz_failures,
    "replay_instructions": replay_instructions, "replay_overhead_cpu": replay_overhead_cpu,
    "tiny_ops": tiny_ops, "warmup_budget": warmup_budget, "grown_steps": grown_steps,
    "host_pool": host_pool, "replay_overhead": replay_overhead, "host_cost": host_cost,
    "host_cost_mechanisms": host_cost_mechanisms, "gpu_projection": gpu_projection, "demo_step": demo_step,
    "whole_model_projection": whole_model_projection, "recompute_cpu": recompute_cpu,
    "disk_store": disk_store, "fast_paths": fast_paths, "disk_tier": disk_tier,
}


def headline(stem: str, doc: dict[str, Any]) -> list[Figure]:
    """The headline of result file ``<stem>.json``; none for comparison and profile files."""
    fn = HEADLINES.get(stem)
    return fn(doc) if fn is not None else []


def write(stem: str, path: Path | str, doc: dict[str, Any], started: dict[str, Any] | None = None,
          indent: int = 1) -> dict[str, Any]:
    """Write result ``stem`` to ``path`` with provenance and the headline this module derives."""
    return write_result(path, doc, headline(stem, doc), started, indent)
