"""Per-op replay guide: how many output leaves an op has and which are activations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyperpar.offload.ir.json_io import IRFormatError, non_negative_int
from hyperpar.offload.ir.json_io import field as json_field

# (shape, dtype name) of a tensor leaf, or None for a non-tensor leaf.
LeafMeta = tuple[tuple[int, ...], str] | None
NOT_ACTIVATION = -1
NO_STORAGE = -2


@dataclass(frozen=True, slots=True)
class OpGuide:
    name: str
    output_leaf_count: int
    output_bindings: dict[int, int] = field(default_factory=dict)  # leaf index -> sid
    output_meta: tuple[LeafMeta, ...] = ()
    # Per tensor input, in argument order: the activation's sid, NOT_ACTIVATION (a parameter,
    # an input from outside the step) or NO_STORAGE (sparse and other storage-less layouts).
    # Replay checks each op's inputs against these. Empty for opaque regions.
    input_sids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "output_leaf_count": self.output_leaf_count,
            "output_bindings": [[k, v] for k, v in sorted(self.output_bindings.items())],
            "output_meta": [None if m is None else [list(m[0]), m[1]] for m in self.output_meta],
            "input_sids": list(self.input_sids),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str) -> OpGuide:
        if not isinstance(doc, dict):
            raise IRFormatError(f"{where}: expected an object, got {doc!r}")
        bindings: dict[int, int] = {}
        for pair in json_field(doc, "output_bindings", list, where):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise IRFormatError(f"{where}: output_bindings entry {pair!r} is not [leaf, sid]")
            bindings[non_negative_int(pair[0], where)] = non_negative_int(pair[1], where)
        meta: list[LeafMeta] = []
        for m in json_field(doc, "output_meta", list, where):
            if m is None:
                meta.append(None)
            elif isinstance(m, list) and len(m) == 2 and isinstance(m[0], list):
                meta.append((tuple(non_negative_int(d, where) for d in m[0]), str(m[1])))
            else:
                raise IRFormatError(f"{where}: output_meta entry {m!r} is not [shape, dtype]")
        raw_inputs = doc.get("input_sids", [])
        if not isinstance(raw_inputs, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= NO_STORAGE for v in raw_inputs
        ):
            raise IRFormatError(f"{where}: input_sids must be a list of integers >= {NO_STORAGE}, "
                                f"got {raw_inputs!r}")
        return cls(
            name=json_field(doc, "name", str, where),
            output_leaf_count=non_negative_int(
                json_field(doc, "output_leaf_count", int, where), where
            ),
            output_bindings=bindings,
            output_meta=tuple(meta),
            input_sids=tuple(raw_inputs),
        )
