"""Warmup's cost per op in CPU instructions (deterministic, unlike time on a shared machine).

Runs ``--steps`` + 1 steps of ``tiny_ops.py``'s model (``--layers`` layers of about 14 ops):
plain, under a do-nothing TorchDispatchMode (``--variant passthrough``), or each as a warmup
of one OffloadSession (``--variant warmup``; planning is skipped, so every step warms up).
Counted under valgrind, the difference between 3 and 1 steps is the cost of 2 steps whatever
the import and set-up cost. ``PYTHONPATH=<other checkout>/src`` counts another version::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
        benchmarks/warmup_instructions.py --variant warmup --layers 200 --steps 3 2>&1 | grep refs
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from tiny_ops import _model, _step  # this folder's: the same model and step

from hyperpar.bench.offload import PassThrough  # the do-nothing dispatch mode
from hyperpar.offload import OffloadConfig, OffloadSession


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("plain", "passthrough", "warmup"), required=True)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, ws, bs = _model(args.layers)
    session = OffloadSession(OffloadConfig(max_resident_fraction=0.5))
    session._after_clean_step = lambda *_: None  # type: ignore[method-assign]  # no plan: warm up again
    ctx: Any = {"plain": None, "passthrough": PassThrough(), "warmup": session}[args.variant]
    for _ in range(1 + args.steps):  # one untimed step
        if ctx is None:
            _step(x, ws, bs)
        else:
            with ctx:
                _step(x, ws, bs)


if __name__ == "__main__":
    main()
