"""Issue 11, item 4: programs that crashed the interpreter on main (SIGSEGV/SIGABRT), each
run in a child interpreter or on spawned ranks so that a crash fails one test: a sparse
embedding gradient, ``torch.sparse.mm`` on a COO made from activations, functional
collectives (outputs written until ``wait_tensor``), a logger thread reading an activation."""

from __future__ import annotations

import pytest

from tests.rank_harness import run_ranks
from tests.reliability.crash_prone_cases import EMBEDDING_FRACTIONS, SPARSE_MM_FRACTIONS, THREAD_READS
from tests.reliability.functional_collective_bodies import functional_collectives_match_plain
from tests.subprocess_harness import case_outcome

CASES = "tests.reliability.crash_prone_cases"


@pytest.mark.parametrize("frac", EMBEDDING_FRACTIONS)
def test_sparse_embedding_trains_bitwise(frac: float) -> None:
    """On main: SIGSEGV in warmup at budgets 0-20 % (the sparse gradient's values evicted,
    then read by ``aten.clone``)."""
    case_outcome(CASES, "cases", f"embedding at {frac}")


@pytest.mark.parametrize("frac", SPARSE_MM_FRACTIONS)
@pytest.mark.parametrize("nonzero", [False, True])
def test_sparse_mm_on_a_coo_of_activations(nonzero: bool, frac: float) -> None:
    """On main: "data is not allocated yet" (the COO's values evicted under it)."""
    case_outcome(CASES, "cases", f"sparse_mm nonzero={nonzero} at {frac}")


def test_functional_collectives_on_two_ranks() -> None:
    """``funcol.all_reduce`` / ``all_gather_tensor`` / ``all_to_all_single`` (and its autograd
    form), and raw ``_c10d_functional`` ops with ``wait_tensor``, at budgets 0 and 50 %: loss
    and gradients bitwise equal to the same program without a session. On main every rank
    died (SIGSEGV) at both budgets. One spawn runs all four combinations (a spawn costs
    seconds); an error in one is reported per combination, a crash names the rank."""
    results = run_ranks(functional_collectives_match_plain, 2, timeout=120)
    for rank, outcome in results.items():
        for combo, found in outcome.items():
            assert found["error"] is None, f"rank {rank}, {combo}: {found['error']}"
            assert found["differs"] == [], f"rank {rank}, {combo}: {found['differs']}"
            assert found["phase"] == "replay", f"rank {rank}, {combo}: {found}"
            if combo.endswith("budget 0.0"):
                assert found["moved"] > 0, f"rank {rank}, {combo}: nothing was offloaded at budget 0"


@pytest.mark.parametrize("how", THREAD_READS)
def test_a_logger_thread_reading_an_activation_mid_step(how: str) -> None:
    """Right values or a clear Python error naming the offload session, never a crash. On main:
    ``h.sum().item()`` from the other thread crashed the interpreter (SIGSEGV); ``h.tolist()``
    returned wrong values or "tolist() shouldn't be called on a tensor with unallocated
    storage"."""
    case_outcome(CASES, "cases", f"logger thread {how}")
