"""``MulticoreModule``: a torch module whose native execution resources are bound lazily,
shared across serial layers, and closed collectively across ranks."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from hyperpar.multicore.collective import is_distributed
from hyperpar.multicore.manager import MANAGER
from hyperpar.multicore.resources import MemberToken, ResourceGroup

logger = logging.getLogger(__name__)


def _check_hashable(name: str, value: Any) -> None:
    try:
        hash(value)
    except TypeError as exc:
        raise TypeError(f"{name} must be hashable, got {type(value).__name__} {value!r}") from exc


_LIFECYCLE_ATTRIBUTES = ("_resource_token", "_resource_was_bound", "_resource_finalizer")


class MulticoreModule(torch.nn.Module):
    """Base class for modules that own long-lived execution resources (workspaces, buffers).

    Subclasses implement ``_create_execution_resources`` and call
    ``self._get_execution_resources(x)`` in ``forward``; the first call binds the module's
    group to ``x``'s device and dtype, collectively on every rank of ``_root_group()``.
    Call ``close()`` in the same order on every rank after the last backward.
    """

    def __init__(self, *, resource_specification: Any = None, resource_compatibility_key: Hashable = None,
                 resource_scope_key: Hashable = None) -> None:
        super().__init__()
        _check_hashable("resource_compatibility_key", resource_compatibility_key)
        _check_hashable("resource_scope_key", resource_scope_key)
        self.resource_specification = resource_specification
        self.resource_compatibility_key = resource_compatibility_key
        self.resource_scope_key = resource_scope_key
        self._join_new_group()

    def _join_new_group(self) -> None:
        module_type = f"{type(self).__module__}.{type(self).__qualname__}"
        group = MANAGER.new_group(module_type, self.resource_compatibility_key, self.resource_scope_key)
        token = MANAGER.new_token(module_type)
        group.members[token] = self.resource_specification
        token.group = group
        self._resource_token: MemberToken | None = token
        self._resource_was_bound = False
        # Retires the membership when the module is collected; never frees native memory.
        self._resource_finalizer = weakref.finalize(self, MANAGER.retire, token)
        self._resource_finalizer.atexit = False

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles carry parameters and configuration, never execution resources."""
        state = dict(self.__dict__)
        for name in _LIFECYCLE_ATTRIBUTES:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, unpickling) gets its own unbound, unshared group."""
        super().__setstate__(state)
        self._join_new_group()

    # ----- subclass hooks ---------------------------------------------------------------
    def _create_execution_resources(self, tensor: torch.Tensor, *, shared: bool,
                                    active_specifications: tuple[Any, ...]) -> Any:
        """Allocate the resources for the first input ``tensor``; ``active_specifications`` holds
        every member's specification when the group is shared. Returns an object with
        ``close()``, ``can_close()`` and ``lifecycle_signature()``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _create_execution_resources")

    def _resource_signature(self, tensor: torch.Tensor) -> Any:
        """What the resources depend on, identical on every rank (compared across ranks before
        binding and used to decide whether an orphan can be reused)."""
        return (repr(self.resource_specification), tensor.device.type, str(tensor.dtype))

    def _root_group(self) -> Any:
        """The process group the resources depend on: binding and closing are collective over it
        and nothing wider. None: this module never communicates."""
        return dist.group.WORLD if is_distributed() else None

    @classmethod
    def _release_execution_runtime(cls) -> None:
        """Release this type's process-wide native runtime. Runs once the last group of the
        process has closed, on every rank of that close, as an agreed stage: a failure raises
        on all of them and a later ``close()`` retries it only on the ranks where it raised (a
        hook that succeeded is never run twice for one release)."""

    # ----- state ------------------------------------------------------------------------
    @property
    def _resource_group(self) -> ResourceGroup | None:
        token = self._resource_token
        return None if token is None else token.group

    @property
    def execution_resources_closed(self) -> bool:
        """True once ``close()`` ran or a cleanup closed the group."""
        group = self._resource_group
        return group is None or group.closed

    @property
    def binding_id(self) -> int | None:
        """Order of the group's first binding on its root group (None while unbound)."""
        group = self._resource_group
        return None if group is None else group.binding_id

    # ----- use ---------------------------------------------------------------------------
    def _check_execution_input(self, x: Any, name: str = "x") -> Exception | None:
        """What ``_get_execution_resources(x)`` would refuse on this rank alone, found without
        communicating: a non-tensor (TypeError), another device or dtype than the binding
        (ValueError), a module closed before its first use (RuntimeError); None if nothing.
        A subclass whose forward communicates before binding feeds it to its own agreement.

        Raises RuntimeError at once when the module was closed, or is closing, after it had
        bound: closing is collective, so that is the same on every rank.
        """
        group = self._resource_group
        cls = type(self).__name__
        if group is None:
            error = RuntimeError(f"{cls}: execution resources used after close()")
            if self._resource_was_bound:
                raise error
            return error
        if group.closed:
            raise RuntimeError(f"{cls}: execution resources were closed ({group.describe()})")
        if group.closing:
            raise RuntimeError(f"{cls}: execution resources are closing after a failed close; call "
                               f"close() again ({group.describe()})")
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{cls}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if group.bound and (x.device != group.device or x.dtype != group.dtype):
            return ValueError(f"{cls}: execution resources (binding id {group.binding_id}) are bound to "
                              f"device={group.device}, dtype={group.dtype}; got device={x.device}, "
                              f"dtype={x.dtype}")
        return None

    def _get_execution_resources(self, x: Any) -> Any:
        """The group's resources, binding them on first use (collectively over ``_root_group()``)."""
        refusal = self._check_execution_input(x)
        group = self._resource_group
        if group is None or not group.bound:  # first use: a refusal is agreed with the peers that bind
            resources = MANAGER.bind(group, self, x, refusal)
            self._resource_was_bound = True
            return resources
        if refusal is not None:
            raise refusal
        return group.resources

    def close(self) -> None:
        """Release this module's membership; the last member of a bound group closes it,
        collectively (call in the same order on every rank). Idempotent; after a failure the
        module keeps its membership and ``close()`` can be retried (a failed runtime release
        is retried by any later ``close()``)."""
        if self._resource_token is None:
            MANAGER.retry_failed_release()
        self._leave(MANAGER.close_member)

    def _release_locally(self, reason: str) -> None:
        """Leave without communicating (teardown after a failure); see ``closing``."""
        self._leave(lambda token: MANAGER.release_member_locally(token, reason))

    def _leave(self, how: Callable[[MemberToken], None]) -> None:
        token = self._resource_token
        if token is None:
            return
        if token.group is not None and token.group.bound:
            self._resource_was_bound = True
        how(token)  # may raise (a failed collective close): the module then stays a member
        self._resource_token = None
        self._resource_finalizer.detach()
        self._forget_communication()

    def _forget_communication(self) -> None:
        """Drop this module's references to process groups and communication objects once it has
        left its group: a process group still referenced after ``destroy_process_group`` is
        freed at interpreter teardown, which can abort the process."""

    @classmethod
    def share_execution_resources(cls, modules: Iterable[MulticoreModule]) -> None:
        """Give serial modules one resource group, before any of them runs. Members keep their
        own parameters; only the execution resources are shared."""
        try:
            members = list(modules)
        except TypeError as exc:
            raise TypeError("share_execution_resources: modules must be an iterable of modules, got "
                            f"{type(modules).__name__}") from exc
        if not members:
            raise ValueError("share_execution_resources: modules is empty")
        for index, module in enumerate(members):
            if not isinstance(module, cls):
                raise TypeError(f"share_execution_resources: modules[{index}] is a "
                                f"{type(module).__name__}, not a {cls.__name__}")
        types = {type(m) for m in members}
        if len(types) > 1:
            raise TypeError("share_execution_resources: modules have different concrete types: "
                            + ", ".join(sorted(t.__qualname__ for t in types)))
        seen: dict[int, int] = {}
        for index, module in enumerate(members):
            if id(module) in seen:
                raise ValueError(f"share_execution_resources: modules[{index}] is the same module as "
                                 f"modules[{seen[id(module)]}]")
            seen[id(module)] = index
        groups: list[ResourceGroup] = []
        for index, module in enumerate(members):
            group = module._resource_group
            if group is None or group.closed:
                raise RuntimeError(f"share_execution_resources: modules[{index}] is closed")
            if group.closing:
                raise RuntimeError(f"share_execution_resources: modules[{index}] is closing")
            groups.append(group)
        if len({id(g) for g in groups}) == 1 and groups[0].shared and len(groups[0].members) == len(members):
            return  # exactly these members already share one group: nothing to do
        first = members[0]
        for index, module in enumerate(members[1:], start=1):
            for key in ("resource_compatibility_key", "resource_scope_key"):
                mine, theirs = getattr(module, key), getattr(first, key)
                if mine != theirs:
                    raise ValueError(f"share_execution_resources: different {key}: modules[0] has "
                                     f"{theirs!r}, modules[{index}] has {mine!r}")
        for index, group in enumerate(groups):
            if group.bound:
                raise RuntimeError(f"share_execution_resources: modules[{index}] already ran "
                                   f"(bound as binding id {group.binding_id}); share before first use")
            if group.shared:
                raise RuntimeError(f"share_execution_resources: modules[{index}] already shares its "
                                   "execution resources with other modules")
        shared = MANAGER.new_group(groups[0].module_type, first.resource_compatibility_key,
                                   first.resource_scope_key, shared=True)
        for module, group in zip(members, groups, strict=True):
            token = module._resource_token
            assert token is not None
            shared.members[token] = group.members.pop(token)
            token.group = shared
        logger.debug("%d %s modules now share one resource group", len(members), cls.__name__)
