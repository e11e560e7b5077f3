"""GPU benchmark: step time and peak device memory of a Llama-style model, five ways.

    python benchmarks/gpu/run.py                     # on a CUDA machine (sizes chosen from its memory)
    python benchmarks/gpu/run.py --device cpu --size tiny   # the same code path, end to end, on CPU

Variants, side by side on one model and one batch: no offload, hyperpar at 50 % and 30 %
of the measured activation peak, ``torch.autograd.graph.save_on_cpu(pin_memory=True)``,
and full activation checkpointing (``torch.utils.checkpoint`` per block). Each variant runs
in its own try/except, so an OOM in one is reported and the others still run. Needs only
torch (2.6+), numpy and this repository (no network, no install: ``src/`` is put on the path).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

REPO = Path(__file__).resolve().parents[2]
try:
    import hyperpar  # noqa: F401
except ModuleNotFoundError:  # a bare checkout on the GPU machine: use the source tree
    sys.path.insert(0, str(REPO / "src"))

from hyperpar.bench.headlines import write  # noqa: E402
from hyperpar.bench.result_file import provenance  # noqa: E402
from hyperpar.models import Llama, LlamaConfig  # noqa: E402
from hyperpar.offload import OffloadConfig, OffloadSession  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from projection_compare import compare  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
VARIANTS = ("no_offload", "hyperpar_50", "hyperpar_30", "save_on_cpu", "checkpoint")
RUN_ORDER = ("no_offload", "checkpoint", "hyperpar_50", "hyperpar_30", "save_on_cpu")  # most host memory last

# Sizing on an accelerator: activations are capped by host memory too (save_on_cpu pins all of
# them, hyperpar at 30 % holds 70 % in its pool), parameters + gradients take a fixed share.
ACT_SHARE_OF_DEVICE = 0.35
ACT_SHARE_OF_HOST = 0.30
PARAM_GRAD_SHARE_OF_DEVICE = 0.35
SEQ_MULTIPLE = 256


@dataclass(frozen=True)
class Size:
    cfg: LlamaConfig
    batch: int
    dtype: torch.dtype
    note: str


# --------------------------------------------------------------------------- machine facts
def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": host_memory_bytes(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                    cuda=torch.version.cuda, gpu_count=torch.cuda.device_count())
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- sizing
def estimated_activation_bytes_per_token(cfg: LlamaConfig, elem: int) -> tuple[int, int]:
    """(per block, for the head + loss), from what autograd saves in this model's plain ops.

    Per block: two RMSNorms (fp32 copy + normalised input), q/k/v/o and gate/up/down inputs,
    SDPA's q, k, v and output, the SwiGLU gate, up and product. Head: logits and their fp32
    copy for the loss plus its gradient buffer.
    """
    d, kv, f = cfg.d_model, cfg.kv_dim, cfg.ffn_hidden
    norm = 4 * d + elem * d
    block = 2 * norm + elem * (d + d + 2 * kv + d + d + d + 4 * f)
    head = norm + elem * d + (elem + 8) * cfg.vocab_size
    return block, head


def measured_activation_bytes_per_token(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype,
                                        seq: int) -> tuple[int, int]:
    """Same figures measured on the device with 1- and 2-block models (memory after forward)."""
    per_model = []
    for n_layer in (1, 2):
        small = replace(cfg, n_layer=n_layer, seq_len=seq)
        with torch.device(device), default_dtype(dtype):
            model = Llama(small)
        idx = torch.randint(0, small.vocab_size, (1, seq), device=device)
        sync(device)
        before = torch.cuda.memory_allocated(device)
        loss = model.loss(idx, idx)
        sync(device)
        per_model.append(torch.cuda.memory_allocated(device) - before)
        del loss, model, idx
        gc.collect()
        torch.cuda.empty_cache()
    block = (per_model[1] - per_model[0]) // seq
    return block, max(per_model[0] // seq - block, 0)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def choose_size(name: str, device: torch.device, log: Callable[[str], None]) -> Size:
    if name == "tiny":
        return Size(LlamaConfig.tiny(), batch=2, dtype=torch.float32, note="preset tiny")
    if name == "small":
        return Size(LlamaConfig.small(), batch=4, dtype=torch.float32, note="preset small")
    if name == "medium":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return Size(LlamaConfig.medium(), batch=4, dtype=dtype, note="preset medium")
    if device.type != "cuda":
        return choose_size("small", device, log)
    # auto on CUDA: Llama-3-8B block shape; layers from the parameter share, tokens from the
    # activation share, both in bytes of this GPU and this host.
    dtype, elem = torch.bfloat16, 2
    gpu = torch.cuda.get_device_properties(device).total_memory
    host = host_memory_bytes() or gpu
    base = LlamaConfig.llama3_8b_shape(n_layer=1)
    per_layer_params = replace(base, n_layer=2).num_parameters() - base.num_parameters()
    fixed_params = base.num_parameters() - per_layer_params
    n_layer = int((PARAM_GRAD_SHARE_OF_DEVICE * gpu / (2 * elem) - fixed_params) // per_layer_params)
    n_layer = max(2, min(n_layer, 96))
    probe_seq = 2048
    est_block, est_head = estimated_activation_bytes_per_token(base, elem)
    try:
        block, head = measured_activation_bytes_per_token(base, device, dtype, probe_seq)
        source = f"measured on {probe_seq} tokens (estimate {est_block}/{est_head})"
    except Exception as exc:  # the estimate is good to a few percent
        block, head = est_block, est_head
        source = f"estimated ({type(exc).__name__} while measuring)"
    act_target = min(ACT_SHARE_OF_DEVICE * gpu, ACT_SHARE_OF_HOST * host)
    tokens = act_target / (n_layer * block + head)
    seq = max(SEQ_MULTIPLE, int(tokens // SEQ_MULTIPLE) * SEQ_MULTIPLE)
    cfg = LlamaConfig.llama3_8b_shape(n_layer=n_layer, seq_len=seq)
    params = cfg.num_parameters()
    act = seq * (n_layer * block + head)
    log(f"sizing: GPU {gpu / GiB:.1f} GiB, host {host / GiB:.1f} GiB")
    log(f"  activation bytes/token: {block} per block, {head} head+loss ({source})")
    log(f"  layers = ({PARAM_GRAD_SHARE_OF_DEVICE} * GPU / (2 * {elem} B) - {fixed_params / 1e9:.2f}e9) "
        f"/ {per_layer_params / 1e6:.0f}e6 params per layer = {n_layer}  -> {params / 1e9:.2f}e9 params, "
        f"{2 * elem * params / GiB:.1f} GiB params+grads")
    log(f"  tokens = min({ACT_SHARE_OF_DEVICE} * GPU, {ACT_SHARE_OF_HOST} * host) / bytes per token "
        f"= {tokens:.0f} -> seq {seq}, batch 1 -> activations ~{act / GiB:.1f} GiB")
    log(f"  expected no-offload footprint ~{(2 * elem * params + act) / GiB:.1f} GiB "
        f"of {gpu / GiB:.1f} GiB")
    note = (f"auto: {n_layer} layers x Llama-3-8B block, seq {seq}, bf16; "
            f"~{act / GiB:.1f} GiB activations, {params / 1e9:.2f}e9 params")
    return Size(cfg, batch=1, dtype=dtype, note=note)


# --------------------------------------------------------------------------- memory meter
class PeakMemory:
    """``torch.cuda.max_memory_allocated`` on CUDA; sampled RSS growth on CPU (labelled so)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.metric = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                       else "peak RSS growth over the timed steps (sampled every 1 ms)")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base = 0
        self._peak = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._base = self._peak = _rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, _rss_bytes())

    def stop(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._peak = max(self._peak, _rss_bytes())
        return self._peak - self._base


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- steps
def loss_of(model: Llama, idx: torch.Tensor, targets: torch.Tensor, checkpoint: bool = False) -> torch.Tensor:
    if not checkpoint:
        return model.loss(idx, targets)
    x, cos, sin = model.embed(idx)
    for block in model.blocks:
        x = torch_checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
    logits = model.head(model.norm(x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def measure_activation_peak(model: Llama, idx: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for backward (device-neutral)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device == idx.device:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(idx, targets)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def run_variant(name: str, model: Llama, idx: torch.Tensor, targets: torch.Tensor, device: torch.device,
                act_peak: int, warmup: int, steps: int,
                traces: dict[str, Any] | None = None) -> dict[str, Any]:
    """One variant's figures; a hyperpar variant's trace goes into ``traces`` (for the projection).

    ``host_ms``: the host's time to issue the step (up to the end of backward, before the loss
    is read back, which waits for the device): its launch cost while the device keeps up, the
    device's time when the launch queue fills."""
    session: OffloadSession | None = None
    result: dict[str, Any] = {}
    if name.startswith("hyperpar_"):
        share = int(name.split("_")[1]) / 100
        budget_mb = share * act_peak / MiB
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_mb, device=device))
        result["budget_mb"] = budget_mb

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        ctx: contextlib.AbstractContextManager[Any]
        if session is not None:
            ctx = session
        elif name == "save_on_cpu":
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            loss = loss_of(model, idx, targets, checkpoint=name == "checkpoint")
            if name != "save_on_cpu":
                loss.backward()
        if name == "save_on_cpu":
            loss.backward()
        host_ms = (time.perf_counter() - t0) * 1e3  # before the read-back below waits for the device
        return float(loss.detach()), host_ms

    try:
        losses, warmup_host = [], []
        for _ in range(warmup):
            sync(device)
            loss_value, host_ms = step()
            losses.append(loss_value)
            warmup_host.append(host_ms)
        meter = PeakMemory(device)
        times, host_times = [], []
        sync(device)
        meter.start()
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            loss_value, host_ms = step()
            losses.append(loss_value)
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            host_times.append(host_ms)
        peak = meter.stop()
        result.update(ok=True, step_ms=statistics.median(times), step_ms_all=times,
                      host_ms=statistics.median(host_times), first_step_host_ms=warmup_host[0],
                      peak_memory_bytes=peak, loss=losses[-1])
        if session is not None and traces is not None and session.trace is not None:
            traces[name] = session.trace
        if session is not None and session.last_report is not None:
            result["report"] = session.last_report.as_dict()
            result["copy_engine"] = getattr(session, "copy_engine_name", None)
    except Exception as exc:  # report it, keep going with the other variants
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc(limit=6))
    finally:
        model.zero_grad(set_to_none=True)
        session = None  # frees its host pool before the next variant
        release_memory(device)
    return result


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def bandwidths(device: torch.device) -> dict[str, Any]:
    """hyperpar's probe (several sizes, each direction and both at once, through its copy engine)."""
    from hyperpar.offload import runtime

    probe = getattr(runtime, "probe_link", None)
    if probe is not None:
        return dict(probe(device).as_dict())
    d2h, h2d = runtime.measure_bandwidth_gbps(device)
    return {"d2h_gbps": d2h, "h2d_gbps": h2d}


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--size", default="auto", choices=("auto", "tiny", "small", "medium"))
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (>= 2: trace + replay)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    p.add_argument("--time-limit", type=float, default=420.0,
                   help="seconds; variants not started by then are reported as skipped")
    p.add_argument("--out", default="hyperpar-bench/gpu.json",
                   help="JSON path (benchmarks/results/gpu.json updates the committed result)")
    args = p.parse_args(argv)
    if args.warmup < 2:
        p.error(f"--warmup must be >= 2 (hyperpar traces on the first step), got {args.warmup}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    started = provenance()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    def log(text: str) -> None:
        print(text, flush=True)

    log(f"torch {torch.__version__} on {device}")
    size = choose_size(args.size, device, log)
    torch.manual_seed(0)
    with torch.device(device), default_dtype(size.dtype):
        model = Llama(size.cfg)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, size.cfg.vocab_size, (size.batch, size.cfg.seq_len + 1), generator=gen)
    idx, targets = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    log(f"model: {size.note}; {size.cfg}")

    act_peak = measure_activation_peak(model, idx, targets)
    log(f"measured activation peak (bytes saved for backward): {act_peak / MiB:.1f} MiB")
    try:
        bw = bandwidths(device)
    except Exception as exc:
        bw = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"host link: {bw}")

    results: dict[str, dict[str, Any]] = {}
    traces: dict[str, Any] = {}
    for name in RUN_ORDER:
        if time.perf_counter() - start > args.time_limit:
            results[name] = {"ok": False, "error": f"skipped: --time-limit {args.time_limit} s reached"}
            continue
        t0 = time.perf_counter()
        results[name] = run_variant(name, model, idx, targets, device, act_peak, args.warmup, args.steps,
                                    traces)
        results[name]["wall_s"] = time.perf_counter() - t0
        r = results[name]
        log(f"  {name:12s} " + (f"{r['step_ms']:10.1f} ms  {r['peak_memory_bytes'] / MiB:10.1f} MiB"
                                if r["ok"] else f"FAILED {r['error']}"))

    base = results["no_offload"]
    log("")
    log(f"{'variant':12s} {'step ms':>10s} {'x plain':>8s} {'peak MiB':>10s} {'x plain':>8s} {'loss':>10s}")
    for name in VARIANTS:
        r = results[name]
        if not r["ok"]:
            log(f"{name:12s} {'FAILED: ' + r['error'][:80]}")
            continue
        t_ratio = r["step_ms"] / base["step_ms"] if base.get("ok") else math.nan
        m_ratio = r["peak_memory_bytes"] / base["peak_memory_bytes"] if base.get("ok") and \
            base["peak_memory_bytes"] > 0 else math.nan
        r["step_time_vs_no_offload"] = t_ratio
        r["memory_vs_no_offload"] = m_ratio
        r["loss_equal_to_no_offload"] = bool(base.get("ok")) and r["loss"] == base["loss"]
        log(f"{name:12s} {r['step_ms']:10.1f} {t_ratio:8.2f} {r['peak_memory_bytes'] / MiB:10.1f} "
            f"{m_ratio:8.2f} {r['loss']:10.5f}")

    info = machine_info(device)
    try:
        projection = compare(results, traces, info.get("gpu"), bw)
    except Exception as exc:  # the measured figures above still get written
        projection = {"error": f"{type(exc).__name__}: {exc}"}
    for name, row in projection.items():
        if isinstance(row, dict) and "projected_ms" in row:
            host, measured, projected = row["host_us_per_op"], row["measured_ms"], row["projected_ms"]
            log(f"projection {name:12s} host us/op plain {host['plain_us']:.1f} "
                f"replay {host['replay_us']:.1f}; "
                f"replay measured {measured['replay']:.1f} ms, projected {projected['replay']:.1f} ms")
    doc = {
        "benchmark": "gpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "device": str(device),
        "machine": info,
        "size": {"note": size.note, "config": asdict(size.cfg), "batch": size.batch,
                 "dtype": str(size.dtype), "parameters": size.cfg.num_parameters()},
        "activation_peak_bytes": act_peak,
        "bandwidth": bw,
        "memory_metric": PeakMemory(device).metric,
        "variants": results,
        "projection": projection,
        "wall_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    write("gpu", out, json.loads(json.dumps(doc, default=str)), started, indent=2)
    log(f"wrote {out} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
