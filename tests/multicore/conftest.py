"""Fixtures for multicore tests. Not autouse: tests under tests/multicore/moe/ are unaffected."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import hyperpar.multicore.manager as manager_module
import hyperpar.multicore.module as module_module
from hyperpar.multicore.manager import ResourceManager


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[ResourceManager]:
    """A private registry, so that one test's groups never meet another's."""
    fresh = ResourceManager()
    monkeypatch.setattr(manager_module, "MANAGER", fresh)
    monkeypatch.setattr(module_module, "MANAGER", fresh)
    yield fresh
