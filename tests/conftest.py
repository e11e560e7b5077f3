"""Session guard: no test may write into the committed ``benchmarks/results/``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def results_hashes() -> dict[str, str]:
    """sha256 of every file under benchmarks/results, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.iterdir())
            if p.is_file()}


@pytest.fixture(scope="session", autouse=True)
def results_unchanged() -> Iterator[None]:
    """Smoke runs write to temporary directories; fail the session if a result file changed."""
    before = results_hashes()
    yield
    after = results_hashes()
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    assert not changed, f"tests changed committed results: {changed}"
