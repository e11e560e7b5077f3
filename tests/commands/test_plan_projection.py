"""``hyperpar plan TRACE --device``: the projection table on a small saved trace, and bad flags."""

from __future__ import annotations

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
