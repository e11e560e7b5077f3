"""The fast greedy must choose exactly the gaps of the plain reference version."""

from __future__ import annotations

import random

from hyperpar.offload.planning.arrays import gap_arrays, trace_arrays
from hyperpar.offload.planning.gaps import find_gaps
from hyperpar.offload.planning.greedy import select_gaps_greedy
from hyperpar.offload.planning.greedy_reference import select_gaps_reference
from tests.offload.planning.random_traces import random_trace


def test_same_choices_as_the_reference_on_random_traces() -> None:
    rng = random.Random(1234)
    taken_any = 0
    for _ in range(600):
        trace = random_trace(rng, max_ops=40)
        expected = select_gaps_reference(trace)
        assert select_gaps_greedy(trace) == expected
        taken_any += bool(expected)
    assert taken_any > 100


def test_gap_arrays_match_the_plain_gap_list() -> None:
    rng = random.Random(99)
    for _ in range(200):
        trace = random_trace(rng, max_ops=30)
        g = gap_arrays(trace_arrays(trace))
        fast = sorted(zip(g.start.tolist(), g.sid.tolist(), g.end.tolist(), g.copy_op.tolist(),
                          g.size.tolist(), strict=True))
        plain = [(x.start, x.sid, x.end, x.copy_op, x.size) for x in find_gaps(trace)]
        assert fast == plain
