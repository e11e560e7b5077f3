"""Checksums see changed and swapped bytes; the timeline writes Chrome trace events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyperpar.offload.runtime import StepTimeline
from hyperpar.offload.runtime import checksum as checksum_module
from hyperpar.offload.runtime.checksum import checksum
from hyperpar.offload.runtime.copy_engine import CopySpan


def test_checksum_sees_changes_and_swaps_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = 4096
    monkeypatch.setattr(checksum_module, "CHUNK_BYTES", chunk)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * chunk + 1000,), dtype=torch.uint8, generator=gen)
    base = checksum(data)
    assert checksum(data.clone()) == base
    flipped = data.clone()
    flipped[chunk + 5] ^= 1
    assert checksum(flipped) != base
    swapped = data.clone()
    swapped[0], swapped[1] = data[1].item(), data[0].item()
    assert data[0] == data[1] or checksum(swapped) != base
    moved = data.clone()
    moved[:chunk], moved[chunk: 2 * chunk] = data[chunk: 2 * chunk], data[:chunk]  # two chunks swapped
    assert checksum(moved) != base
    assert checksum(torch.empty(0, dtype=torch.uint8)) == (0, 0)


def test_timeline_writes_three_named_tracks(tmp_path: Path) -> None:
    tl = StepTimeline(ops=[("aten.mm.default", 0.0, 1.5), ("aten.relu.default", 1.6, 2.0)],
                      copies=[CopySpan("D2H", 3, 4096, 0.2, 0.9), CopySpan("H2D", 3, 4096, 1.0, 1.4)])
    doc = json.loads(tl.write_chrome_trace(tmp_path / "t.json").read_text())
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"compute", "D2H", "H2D"}
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["aten.mm.default", "aten.relu.default", "storage 3", "storage 3"]
    assert slices[0]["dur"] == 1500.0 and slices[2]["args"]["bytes"] == 4096
