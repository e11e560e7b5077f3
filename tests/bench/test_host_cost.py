"""``benchmarks/host_cost.py --quick`` into a temporary folder: phases, mechanisms and profile."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_cost.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("host_cost", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_host_cost_quick_writes_table_headline_and_profiles(tmp_path: Path) -> None:
    host_cost = _load()
    out = tmp_path / "host_cost.json"
    assert host_cost.main(["--quick", "--steps", "hf-llama", "tiny-ops", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == {"hf-llama", "tiny-ops"}
    for step in doc["steps"].values():
        assert set(step["over_plain"]) == {"replay_100", "replay_50", "replay_20", "replay_fastfloor",
                                           "warmup_50"}
        assert step["fast_path_floor_bytes"] > 0  # what the fastfloor column's budget was made from
        assert all(s["min"] <= s["median"] <= s["max"] for s in step["over_plain"].values())
        assert step["replay_reports"]["replay_100"]["bytes_d2h"] == 0
    names = {f["name"] for f in doc["headline"]}
    assert "hf-llama_replay_50_over_plain" in names and "tiny-ops_warmup_50_over_plain" in names
    assert "hf-llama_replay_fastfloor_over_plain" in names
    assert doc["provenance"]["load_average"]["end"] is not None and "| hf-llama |" in doc["table"]

    mech = tmp_path / "mech.json"
    assert host_cost.main(["--quick", "--mechanisms", "--steps", "tiny-ops", "--out", str(mech)]) == 0
    assert set(json.loads(mech.read_text())["steps"]["tiny-ops"]["over_plain"]) == set(host_cost.MECHANISMS)

    assert host_cost.main(["--quick", "--profile", str(tmp_path)]) == 0
    text = (tmp_path / "host_cost_profile_replay.txt").read_text()
    assert "top 25 by tottime" in text and "top 25 by cumulative" in text


def test_fingerprint_hooks_catch_an_in_place_change() -> None:
    import torch

    fp = _load().Fingerprints()
    w = torch.randn(3, requires_grad=True)
    with fp():
        b = w.sin()  # saves w
    with torch.no_grad():
        w.add_(1)  # bumps w._version after pack
    with pytest.raises(RuntimeError, match="changed between pack and unpack"):
        b.sum().backward()
