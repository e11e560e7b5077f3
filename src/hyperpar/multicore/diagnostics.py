"""Turn per-rank values into a sentence that says which rank differs and how.

Every text here is computed from gathered data only, so all ranks build the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ManifestEntry = tuple[int | None, str]  # (binding id, signature)


def _format_entry(entry: ManifestEntry | None) -> str:
    if entry is None:
        return "nothing"
    binding_id, signature = entry[0], entry[1]
    return f"binding id {binding_id} with signature {signature}"


def value_difference(label: str, values: Sequence[Any], ranks: Sequence[int]) -> str | None:
    """None when every rank holds the same value; else each differing rank and its value."""
    reference = values[0]
    differing = [f"rank {rank} has {value!r}" for rank, value in zip(ranks, values, strict=True)
                 if value != reference]
    if not differing:
        return None
    return f"{label}: rank {ranks[0]} has {reference!r}; " + "; ".join(differing)


def manifest_difference(label: str, manifests: Sequence[Sequence[ManifestEntry]],
                        ranks: Sequence[int]) -> str | None:
    """None when every rank lists the same (binding id, signature) entries in the same order;
    else, for each differing rank, the first position where it departs from the first rank."""
    reference = list(manifests[0])
    problems: list[str] = []
    for rank, manifest in zip(ranks[1:], manifests[1:], strict=True):
        manifest = list(manifest)
        if manifest == reference:
            continue
        for position in range(max(len(manifest), len(reference))):
            mine = manifest[position] if position < len(manifest) else None
            theirs = reference[position] if position < len(reference) else None
            if mine != theirs:
                problems.append(f"at position {position} rank {rank} has {_format_entry(mine)} "
                                f"where rank {ranks[0]} has {_format_entry(theirs)}")
                break
    if not problems:
        return None
    return f"{label}: " + "; ".join(problems)
