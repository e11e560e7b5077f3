"""A module never closed before ``destroy_process_group`` holds its buffers until the exit; the
exit then logs one warning naming the groups left open, and never blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import logging, sys, tempfile
    import torch, torch.distributed as dist
    from tests.multicore.fakes import FakeModule
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method="file://" + tempfile.mktemp(prefix="hyperpar-store-"))
    name = dist.group.WORLD.group_name
    module = FakeModule(4)
    module(torch.ones(2))
    print("GROUP", name, flush=True)
    dist.destroy_process_group()   # never closed: the exit must say so, once, and not hang
""")


def test_destroying_the_default_group_names_the_open_groups() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    group = done.stdout.split("GROUP ", 1)[1].split()[0]
    warnings = [line for line in done.stderr.splitlines()
                if "after their process group was destroyed" in line]
    assert len(warnings) == 1, done.stderr
    assert f"process group {group}: binding id 1" in warnings[0], warnings[0]
    assert "close_groups()" in warnings[0]
