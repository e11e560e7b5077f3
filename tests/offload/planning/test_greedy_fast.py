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


def test_a_gap_boundary_keeps_only_gaps_the_fast_path_can_run() -> None:
    """Backward starts at op 6. Storage 1: a gap within forward (its copy back in would come in
    forward), one across, one within backward (its bytes last written in forward: its host copy
    stands). Storage 2 is written again in backward: its last gap's copy out would be there."""
    from dataclasses import replace

    from tests.offload.planning.trace_builders import make_trace

    ops = ["w1 w2", "r1", "x", "x", "r1 r2", "x", "x", "x", "r1", "x", "x", "r1 w2", "x", "x", "r2"]
    trace = make_trace([o.replace("x", "") for o in ops], {1: 100, 2: 100}, budget=100,
                       d2h_gbps=1.0, h2d_gbps=1.0)
    arrays = trace_arrays(trace)
    every = gap_arrays(arrays)
    assert sorted(zip(every.sid.tolist(), every.start.tolist(), every.end.tolist(), strict=True)) == [
        (1, 1, 4), (1, 4, 8), (1, 8, 11), (2, 0, 4), (2, 4, 11), (2, 11, 14)]
    bounded = gap_arrays(replace(arrays, gap_boundary=6))
    assert sorted(zip(bounded.sid.tolist(), bounded.start.tolist(), bounded.end.tolist(), strict=True)) == [
        (1, 4, 8), (1, 8, 11), (2, 4, 11)]
