"""The process-wide registry of bound resource groups: binding, recycling and collective close.

Every step that allocates or frees resources first exchanges a manifest over the group's root
process group, and every failure is agreed on before anyone enters the next collective, so a
rank never waits in a collective that a peer has already abandoned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hyperpar.multicore.collective import (
    CollectiveError,
    agree_on,
    exchange,
    group_ranks,
    is_distributed,
    outcome_of,
    raise_if_any_failed,
)
from hyperpar.multicore.diagnostics import manifest_difference, value_difference
from hyperpar.multicore.resources import MemberToken, ResourceGroup

if TYPE_CHECKING:
    from hyperpar.multicore.module import MulticoreModule

logger = logging.getLogger(__name__)

BINDING_MISMATCH = "binding order or specifications differ across ranks"
CLOSE_MISMATCH = "close order or groups differ across ranks"


class _Scope:
    """Where a group's collectives run: its root process group, or nowhere (not distributed)."""

    __slots__ = ("distributed", "root")

    def __init__(self, distributed: bool, root: Any) -> None:
        self.distributed = distributed
        self.root = root

    @classmethod
    def of(cls, root: Any) -> _Scope:
        if not is_distributed():
            return cls(False, None)
        return cls(True, dist.group.WORLD if root is None else root)

    def key(self) -> tuple[bool, Any]:
        return (self.distributed, self.root)

    def gather(self, value: Any) -> list[Any]:
        return exchange(value, self.root) if self.distributed else [value]

    def ranks(self) -> list[int]:
        return group_ranks(self.root) if self.distributed else [0]

    def agree(self, stage: str, fn: Callable[[], Any]) -> Any:
        """Run fn locally; raise the same CollectiveError on every rank if any rank failed."""
        return agree_on(stage, fn, self.gather, self.ranks())


def _is_idle(group: ResourceGroup) -> bool:
    try:
        return bool(group.resources.can_close())
    except Exception:
        logger.exception("can_close() raised for %s; treating it as busy", group.describe())
        return False


def _lifecycle_text(group: ResourceGroup) -> str:
    try:
        return repr(group.resources.lifecycle_signature())
    except Exception as exc:
        return f"<lifecycle_signature() raised {type(exc).__name__}: {exc}>"


class ResourceManager:
    """Owns every bound group of this process, in binding-id order per root process group."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._groups: list[ResourceGroup] = []  # bound groups that still hold resources
        self._scopes: dict[int, _Scope] = {}  # id(group) -> scope it was bound in
        self._counters: dict[tuple[bool, Any], int] = {}
        self._serial = 0
        self._release_callbacks: list[Callable[[], None]] = []
        self._runtime_active = False
        self.runtime_releases = 0

    # ----- membership -------------------------------------------------------------------
    def new_group(self, module_type: str, compatibility_key: Any, scope_key: Any,
                  shared: bool = False) -> ResourceGroup:
        return ResourceGroup(module_type=module_type, compatibility_key=compatibility_key,
                             scope_key=scope_key, shared=shared)

    def new_token(self, module_type: str) -> MemberToken:
        with self._lock:
            self._serial += 1
            return MemberToken(module_type, self._serial)

    def retire(self, token: MemberToken) -> None:
        """Drop a member (module closed or collected). Never frees resources: a bound group left
        without members stays as an idle orphan for the next binding to recycle."""
        with self._lock:
            group: ResourceGroup | None = getattr(token, "group", None)
            if group is None:
                return
            group.members.pop(token, None)
            token.group = None
            if group.holds_resources and group.orphan:
                logger.debug("%s is now an orphan", group.describe())

    def bound_groups(self, root: Any = ...) -> list[ResourceGroup]:
        """Groups holding resources (all, or those bound under one root process group)."""
        with self._lock:
            groups = list(self._groups)
        if root is not ...:
            groups = [g for g in groups if self._scopes[id(g)].root is root]
        return sorted(groups, key=lambda g: g.binding_id or 0)

    # ----- binding ------------------------------------------------------------------------
    def bind(self, group: ResourceGroup | None, module: MulticoreModule, tensor: Any,
             precheck_error: Exception | None) -> Any:
        """First execution of an unbound group: recycle idle orphans, else create resources.

        Collective over the module's root group; ``precheck_error`` (a local mistake such as a
        non-tensor input) is agreed on first, so the peers raise with this rank.
        """
        scope = _Scope.of(module._root_group())
        with self._lock:
            signature = ""
            if precheck_error is None:
                try:
                    signature = self._requester_signature(group, module, tensor)
                except Exception as exc:
                    precheck_error = exc
            candidates = [g for g in self.bound_groups() if self._scopes[id(g)].key() == scope.key()]
            manifest = [(g.binding_id, g.signature) for g in candidates]
            flags = [(g.orphan, _is_idle(g), self._compatible(g, group, signature, tensor))
                     if precheck_error is None else (False, False, False) for g in candidates]
            key = scope.key()
            next_id = self._counters.get(key, 0) + 1
            gathered = scope.gather((outcome_of(precheck_error), signature, manifest, flags, next_id))
            ranks = scope.ranks()
            raise_if_any_failed("bind", [item[0] for item in gathered], ranks, precheck_error)
            assert group is not None  # a missing group always comes with a precheck error
            detail = (value_difference("requested signature", [item[1] for item in gathered], ranks)
                      or manifest_difference("bound groups", [item[2] for item in gathered], ranks)
                      or value_difference("next binding id", [item[4] for item in gathered], ranks))
            if detail:
                raise CollectiveError.create("bind", {}, f"{BINDING_MISMATCH}: {detail}")
            all_flags = [item[3] for item in gathered]

            def everywhere(position: int, *which: int) -> bool:
                return all(all(rank_flags[position][w] for w in which) for rank_flags in all_flags)

            reuse = next((i for i in range(len(candidates)) if everywhere(i, 0, 1, 2)), None)
            stale = [g for i, g in enumerate(candidates) if i != reuse and everywhere(i, 0, 1)]
            if stale:
                logger.info("recycle: closing %d idle orphan group(s): %s", len(stale),
                            ", ".join(g.describe() for g in stale))
                self._close_agreed(stale, scope, "recycle", release_runtime=False)
            if reuse is not None:
                orphan = candidates[reuse]
                logger.info("recycle: reusing %s", orphan.describe())
                resources = orphan.resources
                self._forget(orphan)
                creation_specs = orphan.creation_specifications
            else:
                resources = self._create(group, module, tensor, scope)
                creation_specs = tuple(repr(s) for s in group.members.values())
            self._counters[key] = next_id
            group.binding_id = next_id
            group.resources = resources
            group.device = tensor.device
            group.dtype = tensor.dtype
            group.root_group = scope.root
            group.signature = signature
            group.creation_specifications = creation_specs
            self._groups.append(group)
            self._scopes[id(group)] = scope
            self._runtime_active = True
        from hyperpar.multicore.cleanup import install_cleanup_hooks

        install_cleanup_hooks()
        logger.debug("bound %s", group.describe())
        return resources

    def _requester_signature(self, group: ResourceGroup | None, module: MulticoreModule,
                             tensor: torch.Tensor) -> str:
        assert group is not None
        return repr((group.module_type, group.shared, module._resource_signature(tensor)))

    def _compatible(self, orphan: ResourceGroup, group: ResourceGroup | None, signature: str,
                    tensor: torch.Tensor) -> bool:
        if group is None:
            return False
        wanted = {repr(s) for s in group.members.values()}
        return (not orphan.closing and orphan.module_type == group.module_type
                and orphan.compatibility_key == group.compatibility_key
                and orphan.scope_key == group.scope_key
                and orphan.signature == signature
                and orphan.device == tensor.device and orphan.dtype == tensor.dtype
                and wanted.issubset(orphan.creation_specifications))

    def _create(self, group: ResourceGroup, module: MulticoreModule, tensor: torch.Tensor,
                scope: _Scope) -> Any:
        specs = tuple(group.members.values())
        created: list[Any] = []

        def create() -> Any:
            resources = module._create_execution_resources(tensor, shared=group.shared,
                                                           active_specifications=specs)
            created.append(resources)
            for name in ("close", "can_close", "lifecycle_signature"):
                if not callable(getattr(resources, name, None)):
                    raise TypeError(f"{type(module).__name__}._create_execution_resources returned "
                                    f"{type(resources).__name__}, which has no {name}() method")
            return resources

        try:
            return scope.agree("create resources", create)
        except CollectiveError:
            for resources in created:  # this rank succeeded but a peer failed: free ours again
                try:
                    resources.close()
                except Exception:
                    logger.exception("closing resources created before a peer failed")
            raise

    # ----- closing ------------------------------------------------------------------------
    def _forget(self, group: ResourceGroup) -> None:
        if group in self._groups:
            self._groups.remove(group)
        self._scopes.pop(id(group), None)

    def _close_agreed(self, groups: Sequence[ResourceGroup], scope: _Scope, stage: str,
                      keep_going: bool = False, release_runtime: bool = True) -> None:
        """Close groups whose manifest and readiness were already agreed, in binding-id order.
        A failure anywhere raises on every rank and leaves that group closing, with its
        resources, so that a retry calls close() again. ``keep_going`` (cleanup) still tries
        the later groups, each outcome agreed on its own, and raises the first failure last."""
        first_error: CollectiveError | None = None
        for group in sorted(groups, key=lambda g: g.binding_id or 0):
            group.closing = True
            try:
                scope.agree(f"{stage}: close binding id {group.binding_id}", group.resources.close)
            except CollectiveError as exc:
                if not keep_going:
                    raise
                first_error = first_error or exc
                continue
            group.closing = False
            group.closed = True
            group.resources = None
            self._forget(group)
            logger.debug("closed %s", group.describe())
        if release_runtime:  # not while recycling: the binding is about to need the runtime again
            self._maybe_release_runtime()
        if first_error is not None:
            raise first_error

    def close_groups(self, groups: Iterable[ResourceGroup], stage: str = "close",
                     keep_going: bool = False) -> None:
        """Collectively close bound groups (all from one root process group): check manifests and
        readiness on every rank, then close in binding-id order."""
        with self._lock:
            groups = sorted((g for g in groups if g.holds_resources), key=lambda g: g.binding_id or 0)
            scopes = {self._scopes[id(g)].key(): self._scopes[id(g)] for g in groups}
            if len(scopes) > 1:
                raise ValueError(f"close_groups: groups come from {len(scopes)} different root process "
                                 "groups; close each root's groups in a separate call")
            scope = next(iter(scopes.values())) if scopes else _Scope.of(None)
            manifest = [(g.binding_id, f"{g.signature} / {_lifecycle_text(g)}") for g in groups]
            busy = [g.binding_id for g in groups if not _is_idle(g)]
            gathered = scope.gather((manifest, busy))
            ranks = scope.ranks()
            detail = manifest_difference(CLOSE_MISMATCH, [item[0] for item in gathered], ranks)
            if detail:
                raise CollectiveError.create(stage, {}, detail)
            not_ready = [f"rank {rank}: binding id(s) {item[1]}" for rank, item in zip(ranks, gathered,
                                                                                       strict=True)
                         if item[1]]
            if not_ready:
                raise CollectiveError.create(
                    stage, {}, "not ready to close (a call in flight or a pending backward holds the "
                               "resources): " + "; ".join(not_ready))
            self._close_agreed(groups, scope, stage, keep_going)

    def close_member(self, token: MemberToken) -> None:
        """``module.close()``: the member retires; if it is the last member of its bound group on
        every rank, the group is closed collectively first (failures keep the member)."""
        with self._lock:
            group: ResourceGroup | None = getattr(token, "group", None)
            if group is None or not group.holds_resources:
                self.retire(token)
                return
            scope = self._scopes[id(group)]
            last = set(group.members) == {token}
            gathered = scope.gather(((group.binding_id, group.signature), last, _is_idle(group)))
            ranks = scope.ranks()
            detail = manifest_difference(CLOSE_MISMATCH, [[item[0]] for item in gathered], ranks)
            if detail:
                raise CollectiveError.create("close", {}, detail)
            if all(item[1] for item in gathered):
                busy = [f"rank {rank}" for rank, item in zip(ranks, gathered, strict=True) if not item[2]]
                if busy:
                    raise CollectiveError.create(
                        "close", {}, f"binding id {group.binding_id} is not ready to close on "
                                     f"{', '.join(busy)} (a call in flight or a pending backward)")
                self._close_agreed([group], scope, "close")
            self.retire(token)

    # ----- process-wide runtime -----------------------------------------------------------
    def register_runtime_release(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once after the last group closes (e.g. to tear down a native runtime)."""
        with self._lock:
            if callback not in self._release_callbacks:
                self._release_callbacks.append(callback)

    def _maybe_release_runtime(self) -> None:
        if not self._runtime_active or self._groups:
            return
        self._runtime_active = False
        self.runtime_releases += 1
        for callback in list(self._release_callbacks):
            try:
                callback()
            except Exception:
                logger.exception("runtime release callback %r failed", callback)

    # ----- cleanup ------------------------------------------------------------------------
    def close_before_destroy(self, process_group: Any) -> None:
        """Collectively close the groups whose root dies with ``process_group`` (None/WORLD: all)."""
        world = dist.group.WORLD
        everything = process_group is None or process_group is world
        with self._lock:
            roots: dict[int, Any] = {}
            for group in self.bound_groups():
                scope = self._scopes[id(group)]
                if scope.distributed and (everything or scope.root is process_group):
                    roots.setdefault(id(scope.root), scope.root)
        ordered = sorted(roots.values(), key=lambda r: (r is not world, getattr(r, "group_name", "")))
        first_error: Exception | None = None
        for root in ordered:
            groups = self.bound_groups(root)
            logger.info("closing %d resource group(s) before destroy_process_group: %s", len(groups),
                        ", ".join(g.describe() for g in groups))
            try:
                self.close_groups(groups, stage="cleanup before destroy_process_group", keep_going=True)
            except CollectiveError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def close_all_at_exit(self) -> None:
        """Interpreter exit: close what is left locally (peers may be gone: no collectives),
        logging each group that was never closed and each failure."""
        with self._lock:
            for group in self.bound_groups():
                logger.warning("resource group never closed before interpreter exit: %s; resources %s %s",
                               group.describe(), type(group.resources).__name__, _lifecycle_text(group))
                try:
                    group.resources.close()
                except Exception:
                    logger.exception("closing %s at exit failed", group.describe())
                    continue
                group.closing = False
                group.closed = True
                group.resources = None
                self._forget(group)
            self._maybe_release_runtime()


MANAGER = ResourceManager()


def close_groups(groups: Iterable[ResourceGroup]) -> None:
    """Close bound resource groups collectively, in binding-id order (same call on every rank)."""
    MANAGER.close_groups(groups)


def register_runtime_release(callback: Callable[[], None]) -> None:
    """Run ``callback`` once after the last resource group of the process closes."""
    MANAGER.register_runtime_release(callback)
