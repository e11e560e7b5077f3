"""A region's reads can die inside it (backward frees the gradients it receives), and CPython
may give a storage made there the dead read's ``id()``: the region's outputs must still be
bound as new storages, on warmup and on the checked replay alike."""

from __future__ import annotations

import torch

from hyperpar.offload import OffloadConfig, OffloadSession
from hyperpar.offload.capture.mode.executor_base import ExecutorBase, internal


def _region_whose_output_takes_a_dead_reads_id(ex: ExecutorBase,
                                               candidates: list[torch.Tensor]) -> torch.Tensor:
    """A region reading a storage of the step that dies inside it, ending with an output whose
    storage object (made after the death) got the dead read's id; returns that output."""
    read = torch.randn(16) + 1.0  # an activation of the step; nothing else holds it
    st = read.untyped_storage()
    assert ex.table.lookup(st) is not None
    dead = id(st)
    with internal(ex):
        token = ex.begin_opaque("region", [st])
    del st, read
    # A storage's Python object is made when first asked for; CPython reuses freed memory.
    out = next(t for t in candidates if id(t.untyped_storage()) == dead)
    with internal(ex):
        ex.end_opaque(token, [out])
    return out


def test_a_region_output_with_the_id_of_a_read_that_died_inside_is_a_new_storage() -> None:
    session = OffloadSession(OffloadConfig(max_resident_fraction=1.0))
    phases = []
    for _ in range(3):  # warmup, then the checked replay of its plan
        candidates = [torch.empty(16) for _ in range(5000)]  # storages without Python objects yet
        with session:
            ex = session._executor
            assert ex is not None
            out = _region_whose_output_takes_a_dead_reads_id(ex, candidates)
            # Taken for the dead read's storage, the output was left unbound (unseen by the budget).
            assert ex.table.lookup(out.untyped_storage()) is not None
            (out * 2).sum()
        assert session.last_report is not None
        phases.append(session.last_report.phase)
    assert phases[0] == "warmup" and "replay" in phases[1], phases
