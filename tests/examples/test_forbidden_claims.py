"""Sentences that were once in the docs and are wrong: each is paired with the behaviour test
that disproves it, so a page that brings one back fails here, and a claim cannot be listed
without the test that shows the code does otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (wrong claim as it would read in a page, the test node id whose behaviour contradicts it)
FORBIDDEN: list[tuple[str, str]] = [
    ("capacity overflows are raised",
     "tests/multicore/moe/test_multi_wave.py::test_two_ranks_overflow_runs_in_waves"),
    ("so release hooks must be idempotent",
     "tests/multicore/test_release_retry.py::test_a_retry_reruns_only_the_hooks_that_failed_on_the_ranks_where_"
     "they_failed"),
    ("overlap_chunks: int = 1)",  # the signature in docs/api.md without gemm_dtype
     "tests/multicore/moe/test_gemm_dtype.py"),
    ("destroy_process_group` is torch's own and closes nothing of ours; a",
     "tests/multicore/test_open_groups_warning.py::test_destroying_the_default_group_names_the_open_groups"),
]


def _flat(text: str) -> str:
    """One line, single spaces, lower case: a claim may be wrapped anywhere in a page."""
    return re.sub(r"\s+", " ", text).lower()


@pytest.mark.parametrize(("claim", "disproof"), FORBIDDEN, ids=[claim for claim, _ in FORBIDDEN])
def test_a_disproved_claim_is_in_no_page(claim: str, disproof: str) -> None:
    path, _, name = disproof.partition("::")
    source = (ROOT / path).read_text()
    assert not name or f"def {name}(" in source, f"{disproof} does not exist: the claim lost its disproof"
    found = [page.name for page in PAGES if _flat(claim) in _flat(page.read_text())]
    assert not found, f"{found} still claim {claim!r}, which {disproof} disproves"
