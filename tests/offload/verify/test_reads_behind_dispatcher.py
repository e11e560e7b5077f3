"""Issue 11, item 3: ``.numpy()``, ``.tolist()``, ``torch.save``, ``repr`` and ``np.asarray`` of
an activation inside a session step read the right values (they reach the bytes without an
aten op the session could page in for). Each runs in a child interpreter, all in one."""

from __future__ import annotations

import pytest

from tests.offload.verify.read_cases import FRACTIONS, READS
from tests.subprocess_harness import case_outcome


@pytest.mark.parametrize("frac", FRACTIONS)
@pytest.mark.parametrize("read", sorted(READS))
def test_read_inside_a_step_gives_plain_values(read: str, frac: float) -> None:
    case_outcome("tests.offload.verify.read_cases", "cases", f"{read} at {frac}")
