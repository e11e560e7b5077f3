"""Every command in README.md and docs/*.md runs as written after the two set-up commands.

The commands are read from the pages themselves: every line of a ``bash`` block, and every
inline code span that starts with ``.venv/bin/``, ``bash``, ``python`` or ``torchrun`` and
has arguments. A
runnable command must be written so that it works from the repository root right after
``bash scripts/demo.sh`` / ``bash scripts/test.sh`` (``.venv/bin/...`` or ``bash
scripts/...``), and must be listed in ``KNOWN`` below with how it runs at a tiny size (or
why it does not run here): a command added to the docs without an entry fails, and so does
an entry whose command left the docs. Spans such as ``hyperpar bench moe`` name a command
in prose; their subcommands and flags must exist.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hyperpar.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"(\.venv/bin/|bash |python3? |torchrun |pip )")
AS_WRITTEN = (".venv/bin/", "bash scripts/")
OUTPUT_FLAGS = ("--out", "--plots", "--traces")  # their values are sent to a scratch folder
DEMO_SCRIPT_LAST_LINE = 'exec .venv/bin/hyperpar demo "$@"'
# Seen once in ~40 torchrun runs under heavy load: gloo aborts a rank in process teardown,
# after the example finished and printed its checks. That one signature gets one retry.
TEARDOWN_ABORT = "terminate called without an active exception"


@dataclass(frozen=True)
class Run:
    """Run the command as written plus ``extra`` (tiny sizes; ``{tmp}`` is a scratch folder)."""

    extra: tuple[str, ...] = ()
    check: Callable[[str], None] | None = None  # on stdout
    needs: str = ""  # "hf" (transformers) or "cuda"
    before: tuple[str, ...] = ()  # run first, same rules (e.g. make the trace a command reads)
    rewrite: dict[str, str] = field(default_factory=dict)  # token -> token, after {tmp} is filled


@dataclass(frozen=True)
class Skip:
    reason: str


def _recompute(out: str) -> None:
    assert "module(s) ['Block']" in out and "bitwise equal" in out, out
    assert "step 4: fast" in out, out


def _fast_paths(out: str) -> None:
    assert "| tiny-ops | WCF |" in out, out  # warmup, one checked replay, fast


def _quickstart(out: str) -> None:
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["warmup", "replay", "replay"]
    for line in lines[1:]:
        peak, budget = (float(x.split()[0]) for x in line.split("peak ")[1].split(" / budget "))
        assert peak <= budget == 16.0 and "0 faults" in line


def _hf_llama(out: str) -> None:
    assert "bitwise equal: True" in out and out.count("replay:") == 1 and out.count("warmup:") == 1


def _moe_torchrun(out: str) -> None:
    for rank in (0, 1):
        assert f"rank {rank}: layer 0 matches the dense reference: True" in out
        assert f"rank {rank}: step 1 loss" in out


def _hf_trainer(out: str) -> None:
    assert "final weights bitwise equal: True" in out and "last micro-batch: replay:" in out


def _fsdp2_torchrun(out: str) -> None:
    for rank in (0, 1):
        assert f"rank {rank}: fsdp on cpu" in out
    assert out.count("losses bitwise equal: True, shards bitwise equal: True") == 2


def _compile_bench(out: str) -> None:
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert set(rows) == {"eager", "compiled", "session_peak", "session_50"}
    assert rows["compiled"][2] == "1.000"  # the reference of the ratios
    assert float(rows["session_peak"][-1]) == 0 < float(rows["session_50"][-1])  # MiB to host


def _mixtral(out: str) -> None:
    assert "output matches the original block" in out and "training losses" in out


def _demo(out: str) -> None:
    assert "bitwise equal (and plain PyTorch repeated itself bit for bit)" in out


def _plan(out: str) -> None:
    assert "peak without offload" in out and "greedy ovh" in out


def _hang_paths(out: str) -> None:
    assert '"outcome": "ok"' in out and "rejected by EP rank(s) 0 before any dispatch" in out


def _fuzz_failures(out: str) -> None:
    assert ": 80 cases: 80 bitwise equal to plain, 0 wrong or failed, 0 crashed" in out


def _tiny_ops(out: str) -> None:
    for key in ("kept_plan_bytes_per_access", "warmup_over_plain", "passthrough_over_plain"):
        assert key in out


def _grown_steps(out: str) -> None:
    assert "first at 256" in out and "budget/peak" in out


def _variable_shapes_models(out: str) -> None:
    assert "gpt2-padded: 2 steps, 1 warmup(s), not bitwise 0" in out


def _warmup_budget(out: str) -> None:
    assert re.search(r"over 1\.05x: \d+ of 4$", out, re.M), out


def _gpu_projection(out: str) -> None:
    assert "tiny (seq 128): " in out and "kernels launch-bound" in out


def _whole_model_projection(out: str) -> None:
    assert "tiny on h100: plain" in out and "mixed" in out and "offloaded_checkpointing" in out


def _recompute_cpu(out: str) -> None:
    assert "hf-gpt2: plain 1.00x" in out and "NOT BITWISE" not in out and "OVER BUDGET" not in out, out


def _disk_store(out: str) -> None:
    assert "raw (" in out and "store, 1 MiB tensors: write" in out and "NOT BITWISE" not in out, out


def _disk_tier_example(out: str) -> None:
    assert "losses bitwise equal to plain; files left in disk_dir after close(): []" in out, out
    went = [float(part.split()[2]) for line in out.splitlines() if line.startswith("step ")
            for part in line.split(", ") if part.startswith("to disk")]
    assert went and max(went) > 0, f"nothing went to disk:\n{out}"


def _disk_tier_bench(out: str) -> None:
    assert "bitwise True" in out and "disk per step:" in out and "peak RSS" in out, out


def _plan_json(out: str) -> None:
    doc = json.loads(out)
    assert {"plain_ms", "step_ms", "full_ac_ms", "peak_bytes", "budget_bytes", "offload_bytes",
            "recompute_bytes"} <= doc.keys()


def _plan_tiers(out: str) -> None:
    assert "to disk MiB   from disk MiB" in out, out
    assert {"device", "host", "disk"} <= {line.split()[0] for line in out.splitlines() if line.split()}, out
    assert "I/O on disk" in out and "ms of" in out, out


def _help(out: str) -> None:
    assert "usage: hyperpar" in out


TINY_DEMO = ("--size", "tiny", "--steps", "1", "--no-moe", "--out", "{tmp}/hyperpar-demo")

KNOWN: dict[str, Run | Skip] = {
    "bash scripts/demo.sh": Run(TINY_DEMO, _demo),  # ends in `exec .venv/bin/hyperpar demo "$@"`
    "bash scripts/demo.sh --steps 2 --no-moe": Run(TINY_DEMO, _demo),
    "bash scripts/test.sh": Skip("it runs this test suite (.ci/run calls it)"),
    ".venv/bin/hyperpar demo": Run(TINY_DEMO, _demo),
    ".venv/bin/hyperpar demo --device cuda": Run(TINY_DEMO, _demo, needs="cuda"),
    ".venv/bin/python -m hyperpar": Run(("--help",), _help),
    ".venv/bin/hyperpar plan hyperpar-demo/trace.json --sweep": Run(
        ("--out", "{tmp}/plan"), _plan, before=(".venv/bin/hyperpar", "demo", *TINY_DEMO),
        rewrite={"hyperpar-demo/trace.json": "{tmp}/hyperpar-demo/trace.json"}),
    ".venv/bin/hyperpar plan hyperpar-demo/trace.json --device h100 --budget-fraction 0.3 --json": Run(
        (), _plan_json, before=(".venv/bin/hyperpar", "demo", *TINY_DEMO),
        rewrite={"hyperpar-demo/trace.json": "{tmp}/hyperpar-demo/trace.json"}),
    ".venv/bin/hyperpar plan hyperpar-demo/trace.json --host-budget-mb 8": Run(
        ("--out", "{tmp}/plan"), _plan_tiers, before=(".venv/bin/hyperpar", "demo", *TINY_DEMO),
        rewrite={"hyperpar-demo/trace.json": "{tmp}/hyperpar-demo/trace.json"}),
    ".venv/bin/python examples/offload_quickstart.py": Run((), _quickstart),
    ".venv/bin/python examples/offload_recompute.py": Run(("--rows", "512", "--steps", "5"), _recompute),
    ".venv/bin/python examples/offload_recompute.py --recompute layers --rows 256": Run(("--steps", "5"),
                                                                                       _recompute),
    ".venv/bin/python examples/offload_hf_llama.py": Run(("--size", "tiny", "--steps", "2"), _hf_llama, "hf"),
    ".venv/bin/python examples/offload_hf_llama.py --size tiny": Run(("--steps", "2"), _hf_llama, "hf"),
    ".venv/bin/torchrun --nproc-per-node 2 examples/moe_torchrun.py": Run(
        ("--size", "tiny", "--steps", "2"), _moe_torchrun),
    ".venv/bin/torchrun --nproc-per-node 2 examples/moe_torchrun.py --size tiny": Run(
        ("--steps", "2"), _moe_torchrun),
    ".venv/bin/torchrun --nproc-per-node 2 examples/moe_hf_mixtral.py": Run((), _mixtral, "hf"),
    ".venv/bin/python examples/offload_hf_trainer.py --size tiny": Run(("--steps", "2"), _hf_trainer, "hf"),
    ".venv/bin/torchrun --nproc-per-node 2 examples/offload_fsdp2_torchrun.py --size tiny": Run(
        ("--steps", "3"), _fsdp2_torchrun),
    ".venv/bin/torchrun --nproc-per-node 2 examples/offload_fsdp2_torchrun.py --size small --steps 6": Run(
        ("--size", "tiny", "--steps", "3"), _fsdp2_torchrun),
    ".venv/bin/python benchmarks/compile_in_session.py": Run(
        ("--quick", "--backend", "aot_eager", "--out", "{tmp}/compile.json"), _compile_bench),
    ".venv/bin/hyperpar bench offload --steps 15 --threads 1 --out benchmarks/results/offload.json": Run(
        ("--quick", "--steps", "2")),
    ".venv/bin/hyperpar bench planner --out benchmarks/results/planner.json --plots benchmarks/results": Run(
        ("--quick",)),
    (".venv/bin/hyperpar bench moe --dtypes float32,bfloat16 --runs 3 --steps 20 "
     "--out benchmarks/results/moe.json"): Skip(
        "tests/multicore/moe/test_bench_quick.py runs the quick MoE benchmark end to end"),
    ".venv/bin/python -m hyperpar.bench.host_pool": Run(
        ("--steps", "20", "--session-steps", "3", "--out", "{tmp}/host_pool.json")),
    ".venv/bin/python benchmarks/variable_lengths.py --out benchmarks/results/variable_lengths.json": Run(
        ("--steps", "6")),
    (".venv/bin/python benchmarks/multicore_hang_paths.py --label after "
     "--out benchmarks/results/multicore_hang_paths.json"): Run(
        ("--only", "ep1_close_on_rank0_only", "expert_weights_on_one_rank"), _hang_paths),
    ".venv/bin/python benchmarks/fuzz_failures.py --out benchmarks/results/fuzz_failures.json": Run(
        (), _fuzz_failures),
    ".venv/bin/python benchmarks/tiny_ops.py --layers 21500 --out benchmarks/results/tiny_ops.json": Run(
        ("--layers", "40", "--out", "{tmp}/tiny_ops.json"), _tiny_ops),
    ".venv/bin/python benchmarks/grown_steps.py --out benchmarks/results/grown_steps.json": Run(
        ("--fractions", "0.4", "--out", "{tmp}/grown_steps.json"), _grown_steps),
    (".venv/bin/python benchmarks/variable_shapes_models.py "
     "--out benchmarks/results/variable_shapes_models.json"): Run(
        ("--models", "gpt2-padded", "--steps", "2", "--out", "{tmp}/variable_shapes_models.json"),
        _variable_shapes_models, "hf"),
    ".venv/bin/python benchmarks/warmup_budget.py --out benchmarks/results/warmup_budget.json": Run(
        ("--models", "gpt2", "--fractions", "0.4", "--out", "{tmp}/warmup_budget.json"), _warmup_budget,
        "hf"),
    ".venv/bin/python benchmarks/gpu_projection.py --out benchmarks/results/gpu_projection.json": Run(
        ("--shapes", "tiny", "--out", "{tmp}/gpu_projection.json"), _gpu_projection, "hf"),
    (".venv/bin/python benchmarks/whole_model_projection.py "
     "--out benchmarks/results/whole_model_projection.json"): Run(
        ("--shapes", "tiny", "--fractions", "0.5", "--devices", "h100", "--out", "{tmp}/whole_model.json"),
        _whole_model_projection, "hf"),
    ".venv/bin/python benchmarks/recompute_cpu.py --out benchmarks/results/recompute_cpu.json": Run(
        ("--families", "hf-gpt2", "--rounds", "4", "--settle", "2", "--out", "{tmp}/recompute_cpu.json"),
        _recompute_cpu, "hf"),
    ".venv/bin/python benchmarks/disk_store.py --out benchmarks/results/disk_store.json": Run(
        ("--mib", "16", "--sizes", "1", "--repeats", "1", "--out", "{tmp}/disk_store.json"), _disk_store),
    ".venv/bin/python examples/offload_disk_tier.py": Run(("--steps", "3"), _disk_tier_example),
    ".venv/bin/python benchmarks/disk_tier.py --out benchmarks/results/disk_tier.json": Run(
        ("--size", "tiny", "--batch-size", "8", "--steps", "3", "--settle", "1", "--rss-steps", "2",
         "--raw-mib", "16", "--out", "{tmp}/disk_tier.json"), _disk_tier_bench),
    ".venv/bin/python benchmarks/fast_paths.py --out benchmarks/results/fast_paths.json": Run(
        ("--families", "tiny-ops", "--fractions", "0.5", "--steps", "3", "--tiny-layers", "20",
         "--out", "{tmp}/fast_paths.json"), _fast_paths),
    ".venv/bin/python benchmarks/gpu/run.py": Skip(
        "tests/benchmarks/test_gpu_script.py runs it as written at --device cpu --size tiny"),
    ".venv/bin/python -m pytest -q tests/reliability": Skip("a part of this test suite"),
    ".venv/bin/python -m pytest -q tests/reliability --durations=10": Skip("a part of this test suite"),
}


def _spans(text: str) -> tuple[list[str], list[str]]:
    """(runnable commands, named hyperpar commands) of one page, in order."""
    runnable: list[str] = []
    # rendered results blocks quote the command each result file records; the table check owns them
    text = re.sub(r"<!-- results(:[\w.-]+)?:begin -->.*?<!-- results(:[\w.-]+)?:end -->", "", text,
                  flags=re.S)
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and (lang in ("bash", "sh", "shell") or RUNNABLE.match(line)):
                runnable.append(line)
    named: list[str] = []
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        span = span.replace("\\|", "|").strip()
        if RUNNABLE.match(span) and " " in span:  # a bare program name is prose, not a command
            runnable.append(span)
        elif span.startswith("hyperpar ") and not span.startswith("hyperpar."):
            named.append(span)
    return runnable, named


def documented() -> tuple[dict[str, str], dict[str, str]]:
    """command -> the first page that shows it, for runnable and for named commands."""
    runnable: dict[str, str] = {}
    named: dict[str, str] = {}
    for page in PAGES:
        found_runnable, found_named = _spans(page.read_text())
        for command in found_runnable:
            runnable.setdefault(command, page.name)
        for command in found_named:
            named.setdefault(command, page.name)
    return runnable, named


def test_every_documented_command_runs_from_the_set_up_venv_and_is_known() -> None:
    runnable, _ = documented()
    not_as_written = {c: p for c, p in runnable.items() if not c.startswith(AS_WRITTEN)}
    assert not not_as_written, ("write these as .venv/bin/... (they fail before the venv is activated): "
                                f"{not_as_written}")
    unknown = {c: p for c, p in runnable.items() if c not in KNOWN}
    assert not unknown, f"add these to KNOWN with how they run at a tiny size: {unknown}"
    stale = sorted(set(KNOWN) - set(runnable))
    assert not stale, f"these KNOWN commands are no longer in the docs: {stale}"


def test_demo_script_hands_its_arguments_to_the_demo() -> None:
    lines = [line for line in (ROOT / "scripts" / "demo.sh").read_text().splitlines() if line.strip()]
    assert lines[-1] == DEMO_SCRIPT_LAST_LINE


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _check_hyperpar_words(words: list[str]) -> list[str]:
    """Problems with ``hyperpar WORDS``: unknown subcommands or flags (values and placeholders
    pass). ``a|b`` and ``a/b`` name alternatives."""
    parsers = [build_parser()]
    for word in (w.strip("[]") for w in words):
        if word.startswith("-"):
            flag = word.split("=")[0]
            if not any(flag in _options(p) for p in parsers):
                return [f"unknown flag {flag}"]
            continue
        subs = [_subparsers(p) for p in parsers]
        if not all(subs):
            continue  # a value or a placeholder
        names = re.split(r"[|/]", word)
        missing = [n for n in names for s in subs if n not in s]
        if missing:
            return [f"unknown command {missing}"]
        parsers = [s[n] for s in subs for n in names]
    return []


def test_named_commands_and_their_flags_exist() -> None:
    runnable, named = documented()
    commands = {**{c: p for c, p in runnable.items() if c.startswith(".venv/bin/hyperpar ")}, **named}
    assert len(commands) > 5
    problems = {}
    for command, page in commands.items():
        found = _check_hyperpar_words(command.removeprefix(".venv/bin/").split()[1:])
        if found:
            problems[f"{page}: {command}"] = found
    assert not problems


def _bin() -> Path:
    venv = ROOT / ".venv" / "bin"
    return venv if venv.is_dir() else Path(sys.executable).parent


def _argv(command: str, plan: Run, tmp: Path) -> list[str]:
    words = shlex.split(command)
    if words[:2] == ["bash", "scripts/demo.sh"]:  # the script installs, then runs exactly this
        words = [".venv/bin/hyperpar", "demo", *words[2:]]
    fill = {k: v.replace("{tmp}", str(tmp)) for k, v in plan.rewrite.items()}
    words = [fill.get(w, w).replace("{tmp}", str(tmp)) for w in [*words, *plan.extra]]
    for i in range(1, len(words)):
        if words[i - 1] in OUTPUT_FLAGS and not words[i].startswith(str(tmp)):
            words[i] = str(tmp / f"ignored-{Path(words[i]).name}")  # never the committed results
    if words[0].startswith(".venv/bin/"):
        words[0] = str(_bin() / words[0].removeprefix(".venv/bin/"))
    return words


def _run(argv: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _results_digest() -> str:
    files = sorted((ROOT / "benchmarks" / "results").glob("*"))
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()


def _unique_runs() -> list[str]:
    """One command per distinct run (a later flag overrides an earlier one, so the demo
    written three ways runs once)."""
    seen: dict[str, str] = {}
    for command, plan in KNOWN.items():
        if isinstance(plan, Run):
            argv = _argv(command, plan, Path("/tmp"))
            if Path(argv[0]).name == "hyperpar":
                key = repr(sorted(vars(build_parser().parse_args(argv[1:])).items()))
            else:
                key = repr(_last_value_wins(argv))
            seen.setdefault(key + repr(plan.before), command)
    return sorted(seen.values())


def _last_value_wins(argv: list[str]) -> list[str]:
    """``argv`` with an option given twice (``--size small ... --size tiny``) kept at its last
    value, as argparse reads it: the fsdp2 example written two ways runs once."""
    last = {word: i for i, word in enumerate(argv) if word.startswith("--") and "=" not in word}
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        repeated = word.startswith("--") and last.get(word, i) != i
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("-")
        if repeated and takes_value:
            i += 2  # an earlier value, overridden later
            continue
        out.append(word)
        i += 1
    return out


@pytest.mark.slow
@pytest.mark.parametrize("command", _unique_runs())
def test_documented_command_runs_at_a_tiny_size(command: str, tmp_path: Path) -> None:
    plan = KNOWN[command]
    assert isinstance(plan, Run)
    if plan.needs == "hf":
        pytest.importorskip("transformers")
    if plan.needs == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    before = _results_digest()
    if plan.before:
        _run(_argv(shlex.join(plan.before), Run(), tmp_path))
    out = _run(_argv(command, plan, tmp_path))
    if plan.check is not None:
        plan.check(out)
    assert _results_digest() == before, "a documented command changed benchmarks/results"
