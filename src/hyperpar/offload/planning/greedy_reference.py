"""The reference greedy gap selection, written plainly (O(gaps x ops)).

Kept as the executable definition of the greedy decisions: ``GreedyPlanner`` must
choose exactly these gaps, only faster. Tests compare the two on random traces.
"""

from __future__ import annotations

from hyperpar.offload.ir import ActivationTrace
from hyperpar.offload.planning.gaps import Gap, find_gaps, greedy_order_key


def select_gaps_reference(trace: ActivationTrace) -> list[Gap]:
    """Gaps in the order taken: longest then largest first, each only if it relieves an op
    that is over budget, stopping once every op fits (bytes only, time ignored)."""
    budget = trace.memory_limit_bytes
    resident = trace.resident_bytes_without_offload()
    if max(resident, default=0) <= budget:
        return []
    chosen: list[Gap] = []
    for gap in sorted(find_gaps(trace), key=greedy_order_key):
        inside = range(gap.start + 1, gap.end)
        if not any(resident[i] > budget for i in inside):
            continue
        for i in inside:
            resident[i] -= gap.size
        chosen.append(gap)
        if max(resident) <= budget:
            break
    return chosen
