"""Every rule and exception type of the module contract, on one process without distribution."""

import gc

import pytest
import torch

from hyperpar.multicore import CollectiveError, MulticoreModule
from hyperpar.multicore.manager import ResourceManager
from tests.multicore.fakes import FakeModule, OtherFakeModule, ReleasingModule


def test_binds_lazily_to_the_first_input(manager: ResourceManager) -> None:
    module = FakeModule(4)
    assert module.binding_id is None and module.create_calls == []
    x = torch.ones(3, dtype=torch.float64)
    out = module(x)
    assert module.binding_id == 1
    assert module.create_calls == [{"shared": False, "specs": (4,), "device": x.device,
                                    "dtype": torch.float64}]
    assert torch.equal(out, x * 8.0 + 4)
    module(torch.zeros(5, dtype=torch.float64))
    assert len(module.create_calls) == 1  # bound once, reused
    second = FakeModule(6)
    second(torch.ones(1))
    assert second.binding_id == 2  # global order of first binding


def test_non_tensor_input_is_a_type_error_before_and_after_binding(manager: ResourceManager) -> None:
    module = FakeModule()
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, got list"):
        module([1.0])
    assert module.binding_id is None and module.create_calls == []
    module(torch.ones(1))
    with pytest.raises(TypeError, match="got int"):
        module(3)


def test_other_device_or_dtype_after_binding_is_a_value_error(manager: ResourceManager) -> None:
    module = FakeModule()
    module(torch.ones(1))
    with pytest.raises(ValueError, match=r"binding id 1\) are bound to device=cpu, dtype=torch.float32; "
                                         r"got device=cpu, dtype=torch.float16"):
        module(torch.ones(1, dtype=torch.float16))


def test_close_is_idempotent_and_later_use_is_a_runtime_error(manager: ResourceManager) -> None:
    module = FakeModule()
    module(torch.ones(1))
    resources = module.created[0]
    module.close()
    module.close()
    assert resources.close_calls == 1 and module.execution_resources_closed
    with pytest.raises(RuntimeError, match="used after close"):
        module(torch.ones(1))
    unbound = FakeModule()
    unbound.close()
    with pytest.raises(RuntimeError, match="used after close"):
        unbound(torch.ones(1))
    assert unbound.create_calls == []


def test_keys_must_be_hashable() -> None:
    with pytest.raises(TypeError, match="resource_compatibility_key must be hashable, got list"):
        FakeModule(key=["a"])
    with pytest.raises(TypeError, match="resource_scope_key must be hashable"):
        FakeModule(scope={"a": 1})


def test_missing_create_hook_says_which_class() -> None:
    class Bare(MulticoreModule):
        pass

    with pytest.raises(CollectiveError, match="Bare must implement _create_execution_resources"):
        Bare()._get_execution_resources(torch.ones(1))


def test_resources_without_the_contract_are_rejected(manager: ResourceManager) -> None:
    module = FakeModule(broken_resources=True)
    with pytest.raises(TypeError, match=r"returned NoCloseResources, which has no close\(\) method"):
        module(torch.ones(1))
    assert module.binding_id is None


def test_failed_creation_leaves_the_group_unbound_for_a_retry(manager: ResourceManager) -> None:
    module = FakeModule(create_error=MemoryError("out of workspace"))
    with pytest.raises(CollectiveError, match=r"create resources.*rank 0: MemoryError: out of workspace"):
        module(torch.ones(1))
    assert module.binding_id is None
    module.create_error = None
    module(torch.ones(1))
    assert module.binding_id == 1


# ----- sharing ----------------------------------------------------------------------------
def test_shared_group_creates_once_for_every_member(manager: ResourceManager) -> None:
    layers = [FakeModule(size) for size in (4, 8, 2)]
    weights = [layer.weight.detach().clone() for layer in layers]
    FakeModule.share_execution_resources(layer for layer in layers)  # any iterable
    outs = [layer(torch.ones(2)) for layer in layers]
    assert layers[0].create_calls == [{"shared": True, "specs": (4, 8, 2), "device": torch.device("cpu"),
                                       "dtype": torch.float32}]
    assert layers[1].create_calls == [] and layers[2].create_calls == []
    assert {layer.binding_id for layer in layers} == {1}
    for layer, weight, out in zip(layers, weights, outs, strict=True):
        assert torch.equal(layer.weight, weight)  # members keep their own parameters
        assert torch.equal(out, torch.ones(2) * weight.sum() + 8)
    resources = layers[0].created[0]
    layers[0].close()
    layers[2].close()
    assert resources.close_calls == 0  # others just retire
    layers[1](torch.ones(1))
    layers[1].close()  # the last member closes the group
    assert resources.close_calls == 1 and resources.closed


def test_share_rejects_empty_and_duplicates(manager: ResourceManager) -> None:
    with pytest.raises(TypeError, match="modules must be an iterable of modules, got FakeModule"):
        FakeModule.share_execution_resources(FakeModule())
    with pytest.raises(ValueError, match="modules is empty"):
        FakeModule.share_execution_resources([])
    a = FakeModule()
    with pytest.raises(ValueError, match=r"modules\[2\] is the same module as modules\[0\]"):
        FakeModule.share_execution_resources([a, FakeModule(), a])


def test_share_rejects_different_keys(manager: ResourceManager) -> None:
    with pytest.raises(ValueError, match=r"different resource_compatibility_key: modules\[0\] has 'x', "
                                         r"modules\[1\] has 'y'"):
        FakeModule.share_execution_resources([FakeModule(key="x"), FakeModule(key="y")])
    with pytest.raises(ValueError, match="different resource_scope_key"):
        FakeModule.share_execution_resources([FakeModule(scope=1), FakeModule(scope=2)])


def test_share_rejects_foreign_and_mixed_types(manager: ResourceManager) -> None:
    with pytest.raises(TypeError, match=r"modules\[1\] is a Linear, not a FakeModule"):
        FakeModule.share_execution_resources([FakeModule(), torch.nn.Linear(1, 1)])
    with pytest.raises(TypeError, match=r"modules\[0\] is a FakeModule, not a OtherFakeModule"):
        OtherFakeModule.share_execution_resources([FakeModule(), OtherFakeModule()])
    with pytest.raises(TypeError, match="different concrete types: FakeModule, OtherFakeModule"):
        FakeModule.share_execution_resources([FakeModule(), OtherFakeModule()])


def test_share_rejects_closed_bound_and_already_shared(manager: ResourceManager) -> None:
    closed = FakeModule()
    closed.close()
    with pytest.raises(RuntimeError, match=r"modules\[1\] is closed"):
        FakeModule.share_execution_resources([FakeModule(), closed])
    bound = FakeModule()
    bound(torch.ones(1))
    with pytest.raises(RuntimeError, match=r"modules\[0\] already ran \(bound as binding id 1\)"):
        FakeModule.share_execution_resources([bound, FakeModule()])
    a, b = FakeModule(), FakeModule()
    FakeModule.share_execution_resources([a, b])
    with pytest.raises(RuntimeError, match=r"modules\[1\] already shares"):
        FakeModule.share_execution_resources([FakeModule(), a])


def test_share_rejects_closing_members(manager: ResourceManager) -> None:
    module = FakeModule(close_failures=1)
    module(torch.ones(1))
    with pytest.raises(CollectiveError):
        module.close()
    with pytest.raises(RuntimeError, match=r"modules\[0\] is closing"):
        FakeModule.share_execution_resources([module, FakeModule()])


# ----- close failures and readiness ---------------------------------------------------------
def test_failed_close_keeps_ownership_and_succeeds_on_retry(manager: ResourceManager) -> None:
    module = FakeModule(close_failures=1)
    module(torch.ones(1))
    resources = module.created[0]
    with pytest.raises(CollectiveError, match=r"close binding id 1' failed on 1 rank\(s\): rank 0: OSError"):
        module.close()
    assert not module.execution_resources_closed and module._resource_group.closing
    with pytest.raises(RuntimeError, match="closing after a failed close"):
        module(torch.ones(1))
    module.close()
    assert resources.close_calls == 2 and resources.closed and module.execution_resources_closed


def test_busy_resources_are_not_closed(manager: ResourceManager) -> None:
    module = FakeModule()
    module(torch.ones(1))
    resources = module.created[0]
    resources.busy = True
    with pytest.raises(CollectiveError, match=r"not ready to close on rank 0 \(binding id\(s\) \[1\]\)"):
        module.close()
    assert resources.close_calls == 0
    module(torch.ones(1))  # still usable: not closing
    resources.busy = False
    module.close()
    assert resources.closed


# ----- orphans ------------------------------------------------------------------------------
def test_collected_module_leaves_an_orphan_that_a_compatible_binding_reuses(manager: ResourceManager) -> None:
    module = FakeModule(4)
    module(torch.ones(1))
    resources = module.created[0]
    del module
    gc.collect()
    (orphan,) = manager.bound_groups()
    assert orphan.orphan and resources.close_calls == 0  # collection never frees native memory
    again = FakeModule(4)
    again(torch.ones(1))
    assert again.create_calls == [] and again._resource_group.resources is resources
    assert again.binding_id == 2 and manager.bound_groups() == [again._resource_group]


def test_incompatible_binding_closes_idle_orphans_and_keeps_busy_ones(manager: ResourceManager) -> None:
    idle, busy = FakeModule(4), FakeModule(4)
    idle(torch.ones(1))
    busy(torch.ones(1))
    idle_res, busy_res = idle.created[0], busy.created[0]
    busy_res.busy = True
    del idle, busy
    gc.collect()
    other = FakeModule(16)
    other(torch.ones(1, dtype=torch.float64))
    assert idle_res.close_calls == 1 and busy_res.close_calls == 0
    assert len(other.create_calls) == 1
    assert [g.binding_id for g in manager.bound_groups()] == [2, 3]


def test_orphan_of_another_dtype_or_key_is_not_reused(manager: ResourceManager) -> None:
    first = FakeModule(4, key="a")
    first(torch.ones(1))
    first_res = first.created[0]
    del first
    gc.collect()
    second = FakeModule(4, key="b")
    second(torch.ones(1))
    assert len(second.create_calls) == 1 and first_res.closed


# ----- runtime release and exit -------------------------------------------------------------
def test_runtime_release_runs_once_after_the_last_group_closes(manager: ResourceManager) -> None:
    calls: list[int] = []
    manager.register_runtime_release(lambda: calls.append(1))
    a, b = FakeModule(1), FakeModule(2)
    a(torch.ones(1))
    b(torch.ones(1))
    a.close()
    assert calls == []
    b.close()
    assert calls == [1]
    manager.close_all_at_exit()
    assert calls == [1] and manager.runtime_releases == 1


def test_exit_logs_every_group_never_closed_and_each_failure(manager: ResourceManager,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []
    manager.register_runtime_release(lambda: calls.append(1))
    kept = FakeModule(3)
    kept(torch.ones(1))
    failing = FakeModule(5, close_failures=1)
    failing(torch.ones(1, dtype=torch.float64))
    with caplog.at_level("WARNING", logger="hyperpar.multicore"):
        manager.close_all_at_exit()
    text = caplog.text
    assert "never closed before interpreter exit: binding id 1 (tests.multicore.fakes.FakeModule" in text
    assert "dtype=torch.float64" in text and "closing binding id 2" in text and "OSError" in text
    assert kept.created[0].closed and not failing.created[0].closed
    assert calls == []  # a group still holds resources
    manager.close_all_at_exit()
    assert failing.created[0].closed and calls == [1]


def test_works_when_torch_distributed_is_unavailable(manager: ResourceManager,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    a, b = FakeModule(2), FakeModule(2)
    FakeModule.share_execution_resources([a, b])
    a(torch.ones(1))
    assert a._root_group() is None and b.binding_id == 1
    a.close()
    b.close()
    assert a.created[0].closed


def test_copies_get_their_own_unbound_group(manager: ResourceManager) -> None:
    import copy
    import pickle

    module = FakeModule(3)
    module(torch.ones(1))
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert clone.binding_id is None and clone._resource_group is not module._resource_group
        assert torch.equal(clone.weight, module.weight)
        clone(torch.ones(1))
        assert clone._resource_group.resources is not module._resource_group.resources
        clone.close()
    assert module.binding_id == 1 and not module.execution_resources_closed
    module.close()


def test_an_orphan_left_closing_is_closed_not_reused(manager: ResourceManager) -> None:
    module = FakeModule(4, close_failures=1)
    module(torch.ones(1))
    resources = module.created[0]
    with pytest.raises(CollectiveError):
        module.close()
    del module
    gc.collect()
    again = FakeModule(4)
    again(torch.ones(1))
    assert len(again.create_calls) == 1 and resources.close_calls == 2 and resources.closed


def test_recycling_does_not_release_the_runtime(manager: ResourceManager) -> None:
    calls: list[int] = []
    manager.register_runtime_release(lambda: calls.append(1))
    old = FakeModule(1)
    old(torch.ones(1))
    del old
    gc.collect()
    new = FakeModule(2)
    new(torch.ones(1))  # closes the last orphan, then creates: the runtime stays up
    assert calls == [] and len(manager.bound_groups()) == 1
    new.close()
    assert calls == [1]


def test_close_groups_closes_in_binding_order_and_keeps_failures_for_a_retry(
        manager: ResourceManager) -> None:
    modules = [FakeModule(size, close_failures=1 if size == 2 else 0) for size in (1, 2, 3)]
    for module in modules:
        module(torch.ones(1))
    log: list[int] = []
    for module in modules:
        module.created[0].log = log
    groups = [m._resource_group for m in reversed(modules)]
    with pytest.raises(CollectiveError, match="close binding id 2' failed on 1 rank"):
        manager.close_groups(groups)
    assert log == [1, 2]  # binding-id order; stops at the failure
    assert [g.binding_id for g in manager.bound_groups()] == [2, 3]
    assert manager.bound_groups()[0].closing and modules[1]._resource_group.resources is not None
    manager.close_groups(groups)
    assert log == [1, 2, 2, 3] and manager.bound_groups() == []
    assert all(m.execution_resources_closed for m in modules)
    with pytest.raises(RuntimeError, match="were closed"):
        modules[0](torch.ones(1))
    for module in modules:
        module.close()  # leaving a closed group is a local no-op


def test_close_groups_checks_readiness_before_closing_anything(manager: ResourceManager) -> None:
    a, b = FakeModule(1), FakeModule(2)
    a(torch.ones(1))
    b(torch.ones(1))
    b.created[0].busy = True
    with pytest.raises(CollectiveError, match=r"not ready to close on rank 0 \(binding id\(s\) \[2\]\)"):
        manager.close_groups([a._resource_group, b._resource_group])
    assert a.created[0].close_calls == 0 and b.created[0].close_calls == 0


# ----- seed parity (issue 14) -----------------------------------------------------------------
def test_active_specifications_cover_every_live_member_of_the_scope(manager: ResourceManager) -> None:
    a, b = FakeModule(2, scope="s"), FakeModule(6, scope="s")
    FakeModule.share_execution_resources([a, b])
    c, closed = FakeModule(4, scope="s"), FakeModule(50, scope="s")
    closed.close()
    OtherFakeModule(70, scope="s")  # another type: its own arena
    FakeModule(90, scope="t")  # another scope
    c(torch.ones(1))
    assert c.create_calls[0]["specs"] == (2, 6, 4)  # creation order, bound or not, shared or not


def test_sharing_the_same_members_again_is_a_no_op(manager: ResourceManager) -> None:
    a, b = FakeModule(), FakeModule()
    FakeModule.share_execution_resources([a, b])
    group = a._resource_group
    FakeModule.share_execution_resources([b, a])
    a(torch.ones(1))
    FakeModule.share_execution_resources((a, b))  # after binding too
    assert a._resource_group is group is b._resource_group and group.binding_id == 1
    with pytest.raises(RuntimeError, match="already ran"):
        FakeModule.share_execution_resources([a])  # a subset is not the same members


def test_close_groups_without_an_argument_closes_everything(manager: ResourceManager) -> None:
    modules = [FakeModule(1), FakeModule(2, local=True), FakeModule(3, scope="s")]
    for module in modules:
        module(torch.ones(1))
    manager.close_groups()
    assert manager.bound_groups() == [] and manager.runtime_releases == 1
    assert all(m.created[0].closed and m.execution_resources_closed for m in modules)


def test_runtime_release_failure_is_raised_and_retried_by_a_later_close(manager: ResourceManager) -> None:
    ReleasingModule.releases, ReleasingModule.fail_on = 0, {0}
    module = ReleasingModule(1)
    module(torch.ones(1))
    with pytest.raises(CollectiveError, match=r"stage 'multicore runtime release' failed on 1 rank.*"
                                              r"OSError: native runtime teardown failed"):
        module.close()
    assert module.execution_resources_closed and manager.runtime_releases == 0
    module.close()  # the retry
    assert ReleasingModule.releases == 2 and manager.runtime_releases == 1
    module.close()
    assert ReleasingModule.releases == 2  # nothing pending: no release
