"""``hyperpar plan TRACE --device``: the projection table on a small saved trace, and bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperpar.cli import main
from tests.offload.projection.test_projection import four_ops


def saved(folder: Path) -> Path:
    """The four-op trace of the projection tests, as ``session.trace.save`` writes it."""
    four_ops().save(folder / "trace.json")
    return folder / "trace.json"


def test_projection_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(saved(tmp_path)), "--device", "H100", "--host-us-plain", "5",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "projection on h100" in out and "host µs/op plain 5, replay 8.8, warmup 27" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("plain", "warmup", "replay")}
    # every op is launch-bound on an H100 at this size: the step is the host's, plus the launch
    # latency and the last op's device time
    assert float(rows["plain"][1]) == pytest.approx(0.024, abs=1e-3)
    assert rows["plain"][5:7] == ["4", "(100%)"]
    assert float(rows["warmup"][1]) > float(rows["replay"][1]) > float(rows["plain"][1])
    assert (tmp_path / "projection.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("flags", "match"), [
    (["--device", "tpu9"], r"--device must be one of .*'tpu9'"),
    (["--device", "h100", "--host-us-replay", "-3"], r"--host-us-replay must be finite and >= 0, got '-3'"),
    (["--device", "h100", "--host-us-plain", "fast"], r"--host-us-plain must be a number of µs, got 'fast'"),
])
def test_bad_flags_name_the_flag_and_value(tmp_path: Path, flags: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        main(["plan", str(saved(tmp_path)), *flags])


@pytest.fixture(scope="module")
def llama_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer HF Llama step's trace, as ``session.trace.save`` writes it."""
    transformers = pytest.importorskip("transformers")
    import torch

    from hyperpar.offload import OffloadConfig, OffloadSession

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=4, vocab_size=512,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=1e6))
    with session:
        model(input_ids=ids, labels=ids).loss.backward()
    assert session.trace is not None
    path = tmp_path_factory.mktemp("llama") / "trace.json"
    session.trace.save(path)
    return path


def test_json_has_every_lever(llama_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(llama_trace), "--device", "h100", "--budget-fraction", "0.3", "--json",
                 "--host-us-replay", "6"]) == 0
    doc = json.loads(capsys.readouterr().out)  # one object, nothing else on stdout
    for key in ("plain_ms", "step_ms", "full_ac_ms", "peak_bytes", "budget_bytes", "offload_bytes",
                "recompute_bytes", "offload_only_ms"):
        assert key in doc, key
    assert doc["layers"] == 4 and doc["layer_ops"] > 0  # the layers found from the op sequence alone
    assert doc["budget_bytes"] == int(0.3 * doc["peak_bytes"]) + doc["kept_bytes"]
    # full checkpointing runs more ops than plain; the mixed plan is the best of its choices,
    # offload alone among them
    assert doc["full_ac_ms"] > doc["plain_ms"] and doc["step_ms"] <= doc["offload_only_ms"]
    assert (doc["recompute_bytes"] > 0) == (doc["rebuilt_layers"] > 0)
    # both floors: rebuilding adds ops and moves none, so the mixed plan's is never below
    assert 0 < doc["offload_only_floor_bytes"] <= doc["floor_bytes"]


def test_the_table_says_the_levers(llama_trace: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(llama_trace), "--device", "h200", "--budget-fraction", "0.5",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "levers at" in out and "full checkpointing" in out and "of 4 layers rebuilt" in out
    assert "MiB made again in backward" in out and "MiB to host, the rest kept on the device" in out
    assert "); floor " in out and "MiB, offload only " in out


@pytest.mark.parametrize(("flags", "match"), [
    (["--budget-fraction", "0.3"], r"--budget-fraction 0.3 needs --device"),
    (["--device", "h100", "--budget-fraction", "1.5"], r"--budget-fraction must be in \(0, 1\], got '1.5'"),
    (["--device", "h100", "--budget-fraction", "half"], r"must be a number in \(0, 1\], got 'half'"),
    (["--device", "h100", "--json"], r"--json needs --device and --budget-fraction"),
])
def test_bad_lever_flags_name_the_flag_and_value(tmp_path: Path, flags: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        main(["plan", str(saved(tmp_path)), *flags])
