"""Prefix hashes agree exactly as long as two programs ran the same ops."""

from __future__ import annotations

from array import array

from hyperpar.offload.capture.checked.prefix_hash import prefix_hashes


def _hashes(in_sids: list[list[int]], binds: list[list[tuple[int, int]]], keys: list[object] | None = None,
            meta: list[int] | None = None, regions: dict[int, int] | None = None) -> list[int]:
    n = len(in_sids)
    in_start, bind_start = array("q", [0]), array("q", [0])
    for ins, b in zip(in_sids, binds, strict=True):
        in_start.append(in_start[-1] + len(ins))
        bind_start.append(bind_start[-1] + len(b))
    return list(prefix_hashes(
        keys or ["op"] * n, in_start, array("q", [s for ins in in_sids for s in ins]), bind_start,
        array("q", [leaf for b in binds for leaf, _ in b]), array("q", [sid for b in binds for _, sid in b]),
        meta or [0] * n, regions or {}))


def test_a_difference_at_one_op_shows_from_that_op_on() -> None:
    ins, binds = [[-1], [0, 1], [2], []], [[(0, 0)], [(0, 2)], [], [(1, 3)]]
    base = _hashes(ins, binds)
    assert _hashes(ins, binds) == base and len(set(base)) == 4
    for changed in (_hashes([[-1], [1, 0], [2], []], binds),  # inputs in another order
                    _hashes(ins, [[(0, 0)], [(1, 2)], [], [(1, 3)]]),  # another output leaf
                    _hashes(ins, binds, keys=["op", "other", "op", "op"]),
                    _hashes(ins, binds, meta=[0, 5, 0, 0]),
                    _hashes(ins, binds, regions={1: 7})):
        assert changed[0] == base[0] and all(a != b for a, b in zip(changed[1:], base[1:], strict=True))
    # inputs moved across an op boundary are another program
    assert _hashes([[-1, 0], [1], [2], []], binds)[1] != base[1]
    assert _hashes(ins[:2], binds[:2]) == base[:2]
