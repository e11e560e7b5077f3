"""The demo's PNG: activation bytes resident on the device at each op, without and with the plan."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)
MIB = 1 << 20


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_resident_bytes(path: Path, plain: Sequence[int], planned: Sequence[int], budget_bytes: int,
                        title: str, floor_bytes: int | None = None) -> Path:
    """Writes ``path``; raises ImportError when matplotlib is missing (the caller decides).
    ``floor_bytes``: the feasible floor, drawn when given."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    try:
        ops = range(len(plain))
        ax.plot(ops, [b / MIB for b in plain], label="without offload", color="tab:gray")
        ax.plot(range(len(planned)), [b / MIB for b in planned], label="with the plan (simulated)",
                color="tab:blue")
        ax.axhline(budget_bytes / MIB, color="tab:red", linestyle="--", label="budget")
        if floor_bytes is not None:
            ax.axhline(floor_bytes / MIB, color="tab:gray", linestyle=":", label="feasible floor")
        ax.set_xlabel("op (forward, then backward)")
        ax.set_ylabel("resident activation MiB")
        ax.set_title(title)
        ax.legend(loc="upper left")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    logger.info("wrote %s", path)
    return path
