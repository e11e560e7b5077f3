"""A host budget with a disk tier: what the host cannot hold goes on to a file and comes back.

The demo's GPT at half its activation peak on the device, with host memory for offloaded
activations limited to a quarter of what a step moves (``--host-share``):
``OffloadConfig(max_host_activation_mb=..., disk_dir=...)`` sends the oldest host copies on
to one file in ``disk_dir`` (direct I/O where the file system allows it, on the session's
I/O thread) and reads them back as backward needs them. Losses are checked bitwise against
plain PyTorch every step; ``session.close()`` then unlinks the file (a failed step and
interpreter exit do too).

    .venv/bin/python examples/offload_disk_tier.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession

MIB = 1 << 20


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.small())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--host-share", type=float, default=0.25,
                   help="host budget: share of the bytes a step moves (default 0.25)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # bitwise against plain: one thread repeats itself
    gen = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")
    batches = [random_batch(GPTConfig.small(), args.batch_size, gen, cpu) for _ in range(args.steps)]

    # a host-only session first: how many bytes a step at this device budget moves
    host_only = OffloadSession(OffloadConfig(max_resident_fraction=0.5))
    probe = build()
    for x, y in batches[:2]:
        with host_only:
            probe.loss(x, y).backward()
        probe.zero_grad(set_to_none=True)
    assert host_only.last_report is not None
    moved = host_only.last_report.bytes_d2h
    host_mb = max(args.host_share * moved / MIB, 1.0)
    print(f"a step moves {moved / MIB:.1f} MiB to host; host budget {host_mb:.1f} MiB")

    plain, model = build(), build()
    with tempfile.TemporaryDirectory() as disk_dir:
        session = OffloadSession(OffloadConfig(max_resident_fraction=0.5, max_host_activation_mb=host_mb,
                                               disk_dir=disk_dir))
        for step, (x, y) in enumerate(batches):
            want = plain.loss(x, y)
            want.backward()
            with session:
                got = model.loss(x, y)
                got.backward()
            if not torch.equal(want, got):
                print(f"step {step}: loss {got.item()} != plain {want.item()}", file=sys.stderr)
                return 1
            r = session.last_report
            assert r is not None
            print(f"step {step}: {r.replay_path or 'warmup'}, device peak "
                  f"{r.peak_resident_bytes / MIB:.1f} MiB of {r.budget_bytes / MIB:.1f}, to host "
                  f"{r.bytes_d2h / MIB:.1f} MiB, to disk "
                  f"{r.bytes_to_disk / MIB:.1f} MiB, back {r.bytes_from_disk / MIB:.1f} MiB, host peak "
                  f"{r.peak_host_bytes / MIB:.1f} MiB")
            for m in (plain, model):
                m.zero_grad(set_to_none=True)
        session.close()
        left = os.listdir(disk_dir)
        print(f"losses bitwise equal to plain; files left in disk_dir after close(): {left}")
        if left:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
