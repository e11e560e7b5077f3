"""Which module calls to rebuild in backward instead of keeping what they save, by cost.

A region is a module (all its forward calls in the step), unless a call writes in place a
storage made before it (its input): run again, it would start from the bytes it wrote.
Rebuilding it costs its forward
ops again in backward (their recorded durations); it frees the bytes its ops save for
backward that nothing after the call reads in forward (its own outputs stay: the next
call reads them, and a checkpointed call keeps its inputs). Offloading those bytes instead
costs the link both ways where compute cannot hide it. So a region is worth rebuilding
when its ops take less time than its freed bytes take on the link, and only while the
offload-only plan leaves copies exposed: a plan whose copies hide behind compute is free,
and a rebuild never is. Cheap regions (norms, activations, casts: many bytes, few FLOPs)
and expensive ones (matmuls, attention) fall out of the durations and sizes, not names.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from hyperpar.offload.planning.arrays import TraceArrays

GBPS_TO_BYTES_PER_MS = 1e6  # 1 GB/s moves 1e6 bytes per ms
EXPOSED_SHARE = 0.03  # an offload-only plan within 3 % of the compute time is left alone
REGION_SHARE = 0.5  # of the budget: the most one rebuilt call may bring back in its backward
HIDE_SHARE = 0.8  # of the link over a phase's compute: what a plan moves there without waits


@dataclass(frozen=True, slots=True)
class Region:
    """A module's forward calls in one step: ``key`` identifies it for the session."""

    key: int
    spans: tuple[tuple[int, int], ...]  # (first op, end op) per call
    depth: int
    freed_bytes: int
    recompute_ms: float
    link_ms: float  # the freed bytes out and back at the trace's link bandwidths

    def overlaps(self, other: Region) -> bool:
        return any(a < d and c < b for a, b in self.spans for c, d in other.spans)


@dataclass
class RecomputeChoice:
    regions: list[Region] = field(default_factory=list)
    why: str = ""
    forward_end: int = 0  # the op backward was taken to start at (where the outermost call ended)


def regions_of(arrays: TraceArrays, calls: list[tuple[int, int, int, int]], d2h_gbps: float,
               h2d_gbps: float) -> list[Region]:
    """Regions from module calls ``(key, first op, end op, depth)`` of the step's forward;
    backward is taken to start where the last call ends."""
    if not calls:
        return []
    forward_end = max(end for _, _, end, _ in calls)
    # per storage: the last op reading or writing it in forward, and whether backward uses it
    in_forward = arrays.access_op < forward_end
    dense = np.searchsorted(arrays.sids, arrays.access_sid)
    last_forward = np.full(len(arrays.sids), -1, dtype=np.int64)
    np.maximum.at(last_forward, dense[in_forward], arrays.access_op[in_forward])
    saved = (arrays.last_op >= forward_end) & (arrays.first_op < forward_end)
    by_first = np.argsort(arrays.first_op, kind="stable")
    first_sorted = arrays.first_op[by_first]
    duration = np.concatenate([[0.0], np.cumsum(arrays.duration_ms)])
    per_key: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for key, first, end, depth in calls:
        per_key[key].append((first, end, depth))
    link = 1.0 / (d2h_gbps * GBPS_TO_BYTES_PER_MS) + 1.0 / (h2d_gbps * GBPS_TO_BYTES_PER_MS)
    # writes in place to storages made before the op: a call doing one to a storage made
    # before it (its input, say) would run again from the bytes it wrote (and write them twice)
    w = arrays.access_write & (arrays.first_op[dense] < arrays.access_op)
    w_op, w_first = arrays.access_op[w], arrays.first_op[dense[w]]
    regions = []
    for key, spans in per_key.items():
        if any(np.any((w_op >= f) & (w_op < e) & (w_first < f)) for f, e, _ in spans):
            continue
        freed = 0
        ms = 0.0
        for first, end, _ in spans:
            if end <= first:
                continue
            made = by_first[np.searchsorted(first_sorted, first):np.searchsorted(first_sorted, end)]
            kept = made[saved[made] & (last_forward[made] < end)]
            freed += int(arrays.size[kept].sum())
            ms += float(duration[end] - duration[first])
        if freed > 0:
            regions.append(Region(key, tuple((f, e) for f, e, _ in spans), min(d for _, _, d in spans), freed,
                                  ms, freed * link))
    return regions


def hideable_bytes(arrays: TraceArrays, calls: list[tuple[int, int, int, int]], d2h_gbps: float,
                   h2d_gbps: float) -> int:
    """Bytes an offload plan can take out in forward and bring back in backward without
    making compute wait: the link over each phase's compute time (``HIDE_SHARE`` of it)."""
    if not calls:
        return 0
    forward_end = max(end for _, _, end, _ in calls)
    forward_ms = float(arrays.duration_ms[:forward_end].sum())
    backward_ms = float(arrays.duration_ms[forward_end:].sum())
    return int(HIDE_SHARE * GBPS_TO_BYTES_PER_MS * min(forward_ms * d2h_gbps, backward_ms * h2d_gbps))


def choose_recompute(regions: list[Region], need_bytes: int, exposed_ms: float, compute_ms: float,
                     budget_bytes: int, everything: bool = False, hidden_bytes: int = 0) -> RecomputeChoice:
    """The regions to rebuild. ``need_bytes``: what the budget makes the plan take off the
    device at its peak; ``exposed_ms``: the offload-only plan's predicted step over its
    compute; ``hidden_bytes``: what offload moves in compute's shadow (``hideable_bytes``),
    so rebuilding frees only the rest, cheapest per byte first. A rebuilt call's bytes all
    come back at once in its backward, so no region rebuilds more than
    ``budget_bytes * REGION_SHARE`` in one call (the whole model as one region would only
    move the peak into backward). ``everything``: full checkpointing per layer instead (the
    regions of the most calls at the shallowest depth: a model's repeated blocks), whatever
    the costs and sizes."""
    if everything:
        return _layers(regions)
    regions = [r for r in regions if r.freed_bytes / len(r.spans) <= budget_bytes * REGION_SHARE]
    why = worth_looking(need_bytes, exposed_ms, compute_ms)
    if why:
        return RecomputeChoice(why=why)
    if need_bytes <= hidden_bytes:
        return RecomputeChoice(why=f"the link moves the {need_bytes} bytes the budget needs off in compute's "
                                   f"shadow ({hidden_bytes} bytes there)")
    need_bytes -= hidden_bytes
    chosen: list[Region] = []
    freed = 0
    spent = 0.0
    for r in sorted(regions, key=lambda r: r.recompute_ms / r.freed_bytes):
        if r.recompute_ms >= r.link_ms or spent + r.recompute_ms > exposed_ms:
            continue  # moving its bytes is cheaper, or it would cost more than all the exposed wait
        if any(r.overlaps(c) for c in chosen):
            continue
        chosen.append(r)
        freed += r.freed_bytes
        spent += r.recompute_ms
        if freed >= need_bytes:
            break
    why = (f"{len(chosen)} region(s) rebuilt: {freed} bytes freed for {spent:.3f} ms of recompute against "
           f"{exposed_ms:.3f} ms of exposed copies" if chosen else
           "no region rebuilds its bytes faster than the link moves them")
    return RecomputeChoice(chosen, why)


def worth_looking(need_bytes: int, exposed_ms: float, compute_ms: float) -> str:
    """Why no region can pay, or "" when some might: a budget that holds the whole peak, or
    an offload-only plan whose copies hide behind compute (a rebuild only adds time)."""
    if need_bytes <= 0:
        return "the budget holds the whole peak: nothing to free"
    if exposed_ms <= EXPOSED_SHARE * compute_ms:
        return (f"the offload-only plan hides its copies ({exposed_ms:.3f} ms exposed over "
                f"{compute_ms:.3f} ms of compute): rebuilding would only add time")
    return ""


def _layers(regions: list[Region]) -> RecomputeChoice:
    """Full checkpointing per layer: among regions of two or more calls' worth of the same
    size (a model's repeated blocks: most calls of equal op counts), the shallowest."""
    groups: dict[tuple[int, int], list[Region]] = defaultdict(list)
    for r in regions:
        sizes = {e - f for f, e in r.spans}
        if len(sizes) == 1:
            groups[(r.depth, sizes.pop())].append(r)
    repeated = [(depth, rs) for (depth, _), rs in groups.items() if len(rs) >= 2]
    if not repeated:
        return RecomputeChoice(why="no repeated blocks to checkpoint")
    depth = min(d for d, _ in repeated)
    chosen = max((rs for d, rs in repeated if d == depth), key=len)
    return RecomputeChoice(list(chosen), f"full checkpointing: {len(chosen)} repeated blocks, depth {depth}")
