"""The destroy_process_group hook and the interpreter-exit report, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hyperpar.multicore.cleanup import install_cleanup_hooks
from hyperpar.multicore.manager import ResourceManager
from tests.multicore.fakes import FakeModule

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import logging, os, sys, tempfile
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    from hyperpar.multicore.cleanup import install_cleanup_hooks
    from tests.multicore.fakes import FakeModule

    original = dist.destroy_process_group
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    failing = FakeModule(5, close_failures=1)
    failing(torch.ones(1))
    ok = FakeModule(6)
    ok(torch.ones(1))
    hook = dist.destroy_process_group
    install_cleanup_hooks()
    print("WRAPPED", hook is not original, dist.destroy_process_group is hook,
          distributed_c10d.destroy_process_group is hook)
    dist.destroy_process_group()
    print("AFTER_DESTROY", dist.is_initialized(), ok.created[0].closed, failing.created[0].closed)
    local = FakeModule(7)
    local(torch.ones(1, dtype=torch.float64))
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    late = FakeModule(8)
    late(torch.ones(1))
    print("EXITING", dist.is_initialized())
""")


def test_destroy_hook_and_exit_report_in_a_fresh_interpreter() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    # the hook is installed once, on both names, at the first binding
    assert "WRAPPED True True True" in out
    # destroy went ahead after a failed close, logged; the other group was still closed
    assert "ERROR closing execution resources before destroy_process_group failed" in out
    assert "close binding id 1' failed on 1 rank(s): rank 0: OSError: fake close failure" in out
    assert "AFTER_DESTROY False True False" in out
    exit_part = out.split("EXITING", 1)[1]
    # at exit: each group never closed is logged with what it was, then closed
    assert ("WARNING resource group never closed before interpreter exit: binding id 1 "
            "(tests.multicore.fakes.FakeModule, 1 member(s), closing, device=cpu, dtype=torch.float32"
            in exit_part)
    assert "resources FakeResources ('FakeResources', 5, False)" in exit_part
    assert "dtype=torch.float64" in exit_part and "('FakeResources', 7, False)" in exit_part
    # still initialised at exit: closed locally all the same (peers may be gone)
    assert exit_part.startswith(" True") and "('FakeResources', 8, False)" in exit_part
    assert "at exit failed" not in exit_part


def test_installing_twice_keeps_one_wrapper(manager: ResourceManager) -> None:
    FakeModule()(torch.ones(1))  # first binding installs
    hook = dist.destroy_process_group
    install_cleanup_hooks()
    assert dist.destroy_process_group is hook
    assert hasattr(hook, "__hyperpar_cleanup_wrapper__")


def test_destroy_without_distribution_still_reaches_torch(manager: ResourceManager) -> None:
    FakeModule()(torch.ones(1))
    with pytest.raises((AssertionError, ValueError, RuntimeError)):  # torch's own: nothing initialised
        dist.destroy_process_group()
