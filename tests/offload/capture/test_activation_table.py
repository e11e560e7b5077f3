"""The activation table's id map holds live bound storages only: replay's lean input check
takes an id found there as that very storage, with no second look."""

from __future__ import annotations

import gc

import torch

from hyperpar.offload.capture.ops.activation_table import ActivationTable


def _storage(n: int) -> torch.UntypedStorage:
    return torch.zeros(n).untyped_storage()


def test_a_dead_storage_leaves_the_id_map() -> None:
    table = ActivationTable()
    table.reserve(2)
    a, b = _storage(4), _storage(8)
    table.bind(0, a, producer=0)
    table.bind(1, b, producer=1)
    key_a = id(a)
    assert table.sid_of == {key_a: 0, id(b): 1} and table.live_bytes == 48
    del a
    gc.collect()
    assert key_a not in table.sid_of and table.ids[0] == 0
    assert table.sid_of == {id(b): 1} and table.live_bytes == 32
    assert table.lookup(b) == 1


def test_rebinding_a_sid_takes_the_old_storage_out() -> None:
    table = ActivationTable()
    table.reserve(1)
    old, new = _storage(4), _storage(8)
    table.bind(0, old, producer=0)
    table.bind(0, new, producer=3)
    assert table.sid_of == {id(new): 0}
    assert table.lookup(old) is None and table.lookup(new) == 0
    assert table.live_bytes == 32 and table.producer[0] == 3
    del old  # no longer ours: its death changes nothing
    gc.collect()
    assert table.sid_of == {id(new): 0} and table.live_bytes == 32 and table.ids[0] == id(new)
    del new
    gc.collect()
    assert table.sid_of == {} and table.live_bytes == 0 and table.ids[0] == 0


def test_an_id_reused_after_death_is_not_found() -> None:
    """CPython hands a dead object's address to the next object of its size: a new storage
    often gets the id of one that died, and must not be taken for it."""
    table = ActivationTable()
    table.reserve(1)
    first = _storage(4)
    table.bind(0, first, producer=0)
    key = id(first)
    del first
    reused = None
    for _ in range(64):
        candidate = _storage(4)
        if id(candidate) == key:
            reused = candidate
            break
    assert table.sid_of.get(key) is None
    if reused is not None:  # the case this guards against happened
        assert table.lookup(reused) is None
