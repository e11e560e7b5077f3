"""Correctness of the async offload runtime on an accelerator, in well under a minute.

    python benchmarks/gpu/check_runtime.py                 # CUDA: copy streams, pinned pool
    python benchmarks/gpu/check_runtime.py --device cpu    # the same checks on the thread engine

For a small Llama at 50 %, 30 % and 0 % of its activation peak, over a warmup and three
replays: loss and every gradient bitwise equal to the same step without offload, no demand
fault at replay, no new host allocation from the second replay on, ``verify=True`` clean,
exposed wait and predicted step time filled, and a Chrome trace with the three tracks.
Prints one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
try:
    import hyperpar  # noqa: F401
except ModuleNotFoundError:  # a bare checkout: use the source tree
    sys.path.insert(0, str(REPO / "src"))

from hyperpar.models import Llama, LlamaConfig  # noqa: E402
from hyperpar.offload import OffloadConfig, OffloadSession  # noqa: E402

MIB = 1 << 20


def step(model: Llama, batch: tuple[torch.Tensor, torch.Tensor],
         session: OffloadSession | None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    if session is None:
        loss = model.loss(*batch)
        loss.backward()
    else:
        with session:
            loss = model.loss(*batch)
            loss.backward()
    return loss.detach()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    args = p.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with _deterministic_attention(device):
        return _run(device)


def _deterministic_attention(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The math SDPA kernel: flash attention's backward accumulates with atomics."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _run(device: torch.device) -> int:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = LlamaConfig.small()
    torch.manual_seed(0)
    base = Llama(cfg).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
    batch = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))
    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1 << 20, device=device))
    step(base, batch, probe)
    assert probe.trace is not None
    peak = max(probe.trace.resident_bytes_without_offload())
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    expected = step(base, batch, None)
    grads = {n: p.grad.clone() for n, p in base.named_parameters() if p.grad is not None}
    again = step(base, batch, None)
    exact = torch.equal(again, expected) and all(
        torch.equal(p.grad, grads[n]) for n, p in base.named_parameters() if p.grad is not None)
    if not exact:
        print("note: two plain steps differ on this device (non-deterministic kernels): comparing with "
              "a tolerance instead of bitwise")

    def same_as_plain(loss: torch.Tensor, model: Llama) -> bool:
        if exact:
            return torch.equal(loss, expected) and all(
                torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if p.grad is not None)
        return torch.allclose(loss, expected, rtol=1e-2, atol=1e-3) and all(
            torch.allclose(p.grad.float(), grads[n].float(), rtol=5e-2, atol=1e-3)
            for n, p in model.named_parameters() if p.grad is not None)

    print(f"torch {torch.__version__} on {device}; activation peak {peak / MIB:.1f} MiB")
    for frac in (0.5, 0.3, 0.0):
        model = copy.deepcopy(base)
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=frac * peak / MIB, device=device,
                                               verify=True, timeline=True))
        allocations = []
        for i in range(4):
            loss = step(model, batch, session)
            report = session.last_report
            assert report is not None
            allocations.append(session.host_allocations())
            kind = "bitwise equal" if exact else "close (tolerance)"
            check(same_as_plain(loss, model), f"{frac:.0%} step {i} ({report.phase}): loss, gradients {kind}")
            if i:
                check(report.demand_faults == 0, f"{frac:.0%} replay {i}: no demand fault")
                check(report.predicted_step_ms is not None, f"{frac:.0%} replay {i}: predicted step time")
        check(allocations[2:] == [allocations[1]] * 2, f"{frac:.0%}: no new host allocation after replay 1 "
                                                        f"({allocations})")
        report = session.last_report
        assert report is not None
        print(f"     {report}; exposed wait {report.exposed_wait_ms:.2f} ms, predicted "
              f"{report.predicted_step_ms} ms, engine {session.copy_engine_name}")
        with tempfile.TemporaryDirectory() as tmp:
            doc = json.loads(session.export_chrome_trace(Path(tmp) / "t.json").read_text())
        tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
        check(tracks == {"compute", "D2H", "H2D"}, f"{frac:.0%}: chrome trace tracks {sorted(tracks)}")
        if frac == 0.0:
            check(report.bytes_d2h > 0 and report.bytes_h2d > 0, "0%: bytes really moved")
    print(f"link: {probe.link_bandwidth}")
    print("all checks passed" if not failures else f"{len(failures)} checks FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
