"""The pieces of ``hyperpar demo``: training runs, the rank launcher, the table and the plot.

Library code (it logs, never prints); the command in :mod:`hyperpar.commands.demo` prints.
"""

from hyperpar.demo.dense import (
    ActivationPeak,
    DemoSpec,
    SideBySide,
    measure_activation_peak,
    train_dense,
    train_side_by_side,
)
from hyperpar.demo.moe_ranks import MoeRunError, run_moe_ranks
from hyperpar.demo.results import DemoResult, RunResult

__all__ = [
    "ActivationPeak",
    "DemoResult",
    "DemoSpec",
    "MoeRunError",
    "RunResult",
    "SideBySide",
    "measure_activation_peak",
    "run_moe_ranks",
    "train_dense",
    "train_side_by_side",
]
