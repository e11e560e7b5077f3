"""Version keepers (``capture.fast.saved_versions``): the saved tensor's version counter without
its bytes, so the fast path raises where plain autograd raises after Python dropped the
tensor, and frees the bytes plain autograd would keep."""

from __future__ import annotations

import weakref

import pytest
import torch

from hyperpar.offload.capture.fast.saved_versions import checked_version, version_keeper


def _saved() -> torch.Tensor:
    w = torch.randn(4, 4, requires_grad=True)
    return torch.tanh(w * 2)


def test_a_keeper_shares_the_counter_not_the_bytes() -> None:
    h = _saved()
    h.add_(0.0)  # version 1
    keeper = version_keeper(h, torch.empty(0))
    assert h._version == 1 and keeper._version == 1  # making it leaves the version as it was
    assert keeper.numel() == 0 and keeper.untyped_storage().nbytes() == 0
    assert not keeper.requires_grad and keeper.grad_fn is None
    alias = h.detach()
    storage = weakref.ref(h.untyped_storage())
    del h
    alias.mul_(2.0)  # through a .detach() alias, with the tensor gone
    assert keeper._version == 2
    del alias
    assert storage() is None  # the keeper keeps no bytes alive


@pytest.mark.parametrize("write", ["view", "itself", "out"])
def test_writes_that_move_the_version_raise_in_autograds_words(write: str) -> None:
    h = _saved()
    keeper = version_keeper(h, torch.empty(0))
    with torch.no_grad():
        if write == "view":
            h[1:].add_(1.0)
        elif write == "itself":
            h.copy_(torch.zeros(4, 4))
        else:
            torch.mul(h.detach(), 2.0, out=h.detach())
    del h
    words = (r"modified by an inplace operation: \[torch.FloatTensor \[4, 4\]\] is at version 1; "
             r"expected version 0")
    with pytest.raises(RuntimeError, match=words):
        checked_version(keeper, 0, torch.Size([4, 4]))


def test_a_data_alias_shares_no_counter() -> None:
    """As in plain PyTorch: a write through ``.data`` is no error (the fast path uses the
    written bytes instead: ``tests/offload/test_saved_aliases.py``)."""
    h = _saved()
    keeper = version_keeper(h, torch.empty(0))
    h.data.add_(1.0)
    assert checked_version(keeper, 0) is keeper
