"""Recompute beside offload: the session rebuilds module calls in backward where that costs
less than the copies offload alone would leave exposed, planned for an H100 while it runs
here.

A stack of cheap blocks (a norm, an activation, dropout: many bytes, few FLOPs) at a budget
of half its activation peak (``--fraction``). With ``plan_for="h100"`` the session prices each module call
on an H100's model (50 GB/s host link, 4 us per launch): moving these blocks' activations
over the link would take far longer than running them again, so it rebuilds the blocks in
backward (no model change) and offloads what is left.
``recompute="layers"`` checkpoints every repeated block whatever the costs;
``recompute="off"`` (the default) never rebuilds. Each run's losses are checked bitwise against plain
PyTorch with the same dropout masks.

    .venv/bin/python examples/offload_recompute.py
    .venv/bin/python examples/offload_recompute.py --recompute layers --rows 256
"""

from __future__ import annotations

import argparse
import sys

import torch

from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.nn.functional.gelu(self.norm(x)))


def build(width: int, blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(blocks)])


def train(model: torch.nn.Module, x: torch.Tensor, steps: int, session: OffloadSession | None) -> list[float]:
    losses = []
    for step in range(steps):
        torch.manual_seed(step)  # the same dropout masks with and without the session
        if session is None:
            loss = model(x).square().mean()
            loss.backward()
        else:
            with session:
                loss = model(x).square().mean()
                loss.backward()
            report = session.last_report
            assert report is not None
            print(f"step {step}: {report.replay_path or 'warmup'}, "
                  f"peak {report.peak_resident_bytes / MIB:.1f} MiB of {report.budget_bytes / MIB:.1f}, "
                  f"recomputed {report.bytes_recomputed / MIB:.1f} MiB, "
                  f"offloaded {report.bytes_d2h / MIB:.1f} MiB")
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recompute", choices=("auto", "layers", "off"), default="auto")
    parser.add_argument("--plan-for", default="h100", help="a device model (h100, h200, a100) or 'here'")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.5, help="the budget, of the activation peak")
    args = parser.parse_args()
    torch.set_num_threads(1)  # plain PyTorch repeats itself bit for bit on one thread
    x = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(1))

    probe = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6, recompute="off"))
    with probe:
        build(args.width, args.blocks)(x).square().mean().backward()
    assert probe.last_report is not None
    budget = probe.last_report.peak_resident_bytes * args.fraction
    plan_for = None if args.plan_for == "here" else args.plan_for
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, recompute=args.recompute,
                                           plan_for=plan_for))
    plain = train(build(args.width, args.blocks), x, args.steps, None)
    ours = train(build(args.width, args.blocks), x, args.steps, session)
    rebuilt = session._recompute.names if session._recompute is not None else []
    print(f"rebuilt in backward: {len(rebuilt)} module(s) {sorted(set(rebuilt))}")
    same = plain == ours
    print(f"losses with and without the session: {'bitwise equal' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
