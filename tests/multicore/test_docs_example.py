"""The subclass example in docs/multicore.md runs as written."""

import re
from pathlib import Path

from hyperpar.multicore.manager import ResourceManager

DOC = Path(__file__).resolve().parents[2] / "docs" / "multicore.md"


def test_subclass_example_runs(manager: ResourceManager) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (example,) = [block for block in blocks if "class Scale(MulticoreModule)" in block]
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(example, str(DOC), "exec"), namespace)
    assert manager.bound_groups() == [] and manager.runtime_releases == 1
