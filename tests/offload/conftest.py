"""A fixed host link for tests that assert which replay path a plan takes.

The session plans on the link ``probe_link`` measures, and a plan predicted over its budget
on that link rightly never runs fast (the fast path cannot wait for a copy out to free its
bytes). The probe is a timing: on a loaded machine it reads several times slower than idle
(3x is enough to tip these tests' plans over their budgets). Tests about the paths take the
link as a fixed input instead, as the planner's other inputs are.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import hyperpar.offload.api.session as session_module
from hyperpar.offload.runtime import LinkBandwidth

STEADY_GBPS = 10.0


@pytest.fixture
def steady_link(monkeypatch: pytest.MonkeyPatch) -> Iterator[LinkBandwidth]:
    """Every session of the test plans on ``STEADY_GBPS`` each way (both at once too)."""
    link = LinkBandwidth(STEADY_GBPS, STEADY_GBPS, STEADY_GBPS, STEADY_GBPS, engine="steady")

    def probe(device: torch.device, engine: object = None) -> LinkBandwidth:
        return link

    monkeypatch.setattr(session_module, "probe_link", probe)
    yield link
