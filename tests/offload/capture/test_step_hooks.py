"""What a session wraps on torch is installed once, at its first step, kept across steps and
removed when the last session that stepped is gone (a fresh interpreter, so no other test's
session holds it)."""

from __future__ import annotations

from tests.subprocess_harness import run_python

CODE = """
import gc
import torch
from torch._dynamo.eval_frame import OptimizedModule
from hyperpar.offload import OffloadConfig, OffloadSession

def wrapped():
    return (torch.Tensor.__dict__.get("tolist"), torch.sparse_coo_tensor,
            OptimizedModule.__dict__.get("__call__"), torch.Tensor.__dict__.get("data"))

before = wrapped()
w = torch.randn(4, 4, requires_grad=True)
session = OffloadSession(OffloadConfig(max_resident_activation_mb=0, device="cpu"))
assert wrapped() == before, "nothing is installed before the first step"
with session:
    (w @ w).relu().sum().backward()
first = wrapped()
assert all(a is not b for a, b in zip(first, before)), "installed at the first step"
assert torch.tensor([1.5, 2.0]).tolist() == [1.5, 2.0], "a wrapper outside a step only calls the original"
p = torch.nn.Parameter(torch.zeros(2))
p.data = torch.ones(2)  # the wrapped .data sets as the original does
assert p.data.sum() == 2 and isinstance(p, torch.nn.Parameter) and p.data._version == 0
for _ in range(2):
    w.grad = None
    with session:
        (w @ w).relu().sum().backward()
    assert session.last_report.diverged_at is None
assert all(a is b for a, b in zip(wrapped(), first)), "kept across steps, not re-installed"
other = OffloadSession(OffloadConfig(max_resident_activation_mb=0, device="cpu"))
with other:
    (w @ w).relu().sum().backward()
del session
gc.collect()
assert all(a is b for a, b in zip(wrapped(), first)), "another live session still holds them"
del other
gc.collect()
assert wrapped() == before, "removed with the last session"
print("OK")
"""


def test_wrappers_live_with_the_sessions_not_the_steps() -> None:
    done = run_python(CODE)
    assert done.code == 0 and done.stdout.strip().endswith("OK"), done.describe()
