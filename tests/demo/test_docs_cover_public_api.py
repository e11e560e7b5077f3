"""docs/api.md names every public name, so a new export without documentation fails here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PACKAGES = [
    "hyperpar.offload", "hyperpar.offload.api", "hyperpar.offload.ir", "hyperpar.offload.capture",
    "hyperpar.offload.planning", "hyperpar.offload.runtime", "hyperpar.multicore", "hyperpar.multicore.moe",
    "hyperpar.models", "hyperpar.demo", "hyperpar.integrations", "hyperpar.integrations.hf",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_in_the_api_reference(package: str) -> None:
    text = (DOCS / "api.md").read_text()
    assert f"`{package}`" in text, f"docs/api.md has no section for {package}"
    missing = [name for name in importlib.import_module(package).__all__ if f"`{name}" not in text]
    assert not missing, f"docs/api.md does not mention {package}: {missing}"


def test_relative_links_in_the_docs_and_readme_resolve() -> None:
    pages = [DOCS / "index.md", DOCS / "architecture.md", DOCS / "api.md", DOCS.parent / "README.md"]
    broken = []
    for page in pages:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not links
        for target in re.findall(r"\]\(([^)#:]+)\)", prose):
            if not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert not broken, broken
