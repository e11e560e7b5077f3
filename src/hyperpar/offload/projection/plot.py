"""Per-op device time against host cost on each path (matplotlib: ``pip install hyperpar[plot]``)."""

from __future__ import annotations

from pathlib import Path

from hyperpar.offload.projection.timeline import Projection


def plot_projection(path: Path, proj: Projection, title: str) -> None:
    """Ops above a host line are compute- or memory-bound there; ops below it are launch-bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    pairs = zip(proj.device_us, proj.costs.ops, strict=True)
    kernels = [(i, d) for i, (d, c) in enumerate(pairs) if c.kernel]
    ax.scatter([i for i, _ in kernels], [max(d, 1e-3) for _, d in kernels], s=4, color="C0",
               label=f"device time ({proj.device.name} roofline)")
    for value, name, color in ((proj.host.plain_us, "plain", "C2"), (proj.host.replay_us, "replay", "C3"),
                               (proj.host.warmup_us, "warmup", "0.5")):
        ax.axhline(max(value, 1e-3), color=color, ls="--", lw=1, label=f"host {name} {value:g} µs/op")
    ax.set_yscale("log")
    ax.set_xlabel("op")
    ax.set_ylabel("µs")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
