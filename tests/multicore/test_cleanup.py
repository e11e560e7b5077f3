"""Teardown never communicates: torch is not patched, a close() after destroy_process_group runs on
this rank alone, and interpreter exit releases what is left locally (in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hyperpar.multicore import closing
from hyperpar.multicore.manager import ResourceManager
from tests.multicore.fakes import FakeModule

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import logging, os, sys, tempfile
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    from tests.multicore.fakes import FakeModule

    original = dist.destroy_process_group, distributed_c10d.destroy_process_group
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    closed_after = FakeModule(5)
    closed_after(torch.ones(1))
    left_open = FakeModule(6, close_failures=1)
    left_open(torch.ones(1))
    print("UNPATCHED", (dist.destroy_process_group, distributed_c10d.destroy_process_group) == original)
    dist.destroy_process_group()
    print("AFTER_DESTROY", dist.is_initialized(), closed_after.created[0].closed, left_open.created[0].closed)
    closed_after.close()
    print("CLOSED_AFTER_DESTROY", closed_after.created[0].closed, closed_after.execution_resources_closed)
    local = FakeModule(7)
    local(torch.ones(1, dtype=torch.float64))
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    late = FakeModule(8)
    late(torch.ones(1))
    print("EXITING", dist.is_initialized())
""")


def test_teardown_is_local_and_exit_releases_what_is_left() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    assert "UNPATCHED True" in out  # binding does not touch torch
    assert "AFTER_DESTROY False False False" in out  # destroy is torch's own: it closes nothing of ours
    # close() after destroy runs on this rank alone, saying so
    assert "WARNING close: process group 0 is no longer initialised; running on this rank alone" in out
    assert "CLOSED_AFTER_DESTROY True True" in out
    exit_part = out.split("EXITING", 1)[1]
    assert exit_part.startswith(" True")
    # at exit: each group never closed is logged with what it was and released locally, in binding
    # order per scope; one whose close() fails is logged and left
    assert ("WARNING resource group never closed before interpreter exit: binding id 2 "
            "(tests.multicore.fakes.FakeModule, 1 member(s), open, device=cpu, dtype=torch.float32"
            in exit_part)
    assert "resources FakeResources ('FakeResources', 6, False)" in exit_part
    assert "ERROR closing binding id 2" in exit_part and "OSError: fake close failure" in exit_part
    assert "dtype=torch.float64" in exit_part and "('FakeResources', 7, False)" in exit_part
    assert "('FakeResources', 8, False)" in exit_part
    assert "no longer initialised" not in exit_part  # exit never tries to communicate


def test_closing_closes_in_order_after_success(manager: ResourceManager) -> None:
    modules = [FakeModule(1), FakeModule(2)]
    log: list[int] = []
    with closing(modules) as inside:
        for module in inside:
            module(torch.ones(1))
            module.created[0].log = log
    assert inside == modules and log == [1, 2]
    assert all(m.execution_resources_closed for m in modules) and manager.bound_groups() == []


def test_closing_releases_locally_after_an_exception(manager: ResourceManager,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    shared = [FakeModule(1), FakeModule(2)]
    FakeModule.share_execution_resources(shared)
    busy = FakeModule(3)
    error = RuntimeError("user code failed")
    with caplog.at_level("WARNING", logger="hyperpar.multicore"), pytest.raises(RuntimeError) as info:
        with closing([*shared, busy]):
            shared[0](torch.ones(1))
            busy(torch.ones(1))
            busy.created[0].busy = True
            raise error
    assert info.value is error  # the original exception, untouched
    assert shared[0].created[0].closed and shared[0].created[0].close_calls == 1
    assert "an exception left a closing() block: binding id 1" in caplog.text
    # a busy group is not freed under its user: it stays, as an orphan, for the exit or a recycle
    assert not busy.created[0].closed and "binding id 2 is in use" in caplog.text
    assert all(m.execution_resources_closed for m in (*shared, busy))
    assert [g.binding_id for g in manager.bound_groups()] == [2] and manager.bound_groups()[0].orphan
