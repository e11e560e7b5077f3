"""The process-wide registry of resource groups: binding, recycling, collective close, the
runtime release, and the local release that teardown uses.

Every step that allocates or frees resources first exchanges a manifest over the group's root
process group and nothing wider (a module without a root never communicates), and every failure
is agreed on before anyone enters the next collective, so a rank never waits in a collective
that a peer has already abandoned. The local release is the one exception: it never
communicates, so that a failing rank can always tear down at once.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from hyperpar.multicore.collective import CollectiveError, Scope, outcome_of, raise_if_any_failed
from hyperpar.multicore.diagnostics import manifest_difference, value_difference
from hyperpar.multicore.release import Hook, ReleaseHooks
from hyperpar.multicore.resource_owner import ResourceOwner
from hyperpar.multicore.resources import MemberToken, ResourceGroup

logger = logging.getLogger(__name__)

BINDING_MISMATCH = "binding order or specifications differ across ranks"
CLOSE_MISMATCH = "close order or groups differ across ranks"
RUNTIME_RELEASE = "multicore runtime release"
NEVER_CLOSED = "resource group never closed before interpreter exit"
OPEN_AFTER_DESTROY = "process group destroyed with resource groups open"


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


def _by_binding_id(groups: Iterable[ResourceGroup]) -> list[ResourceGroup]:
    return sorted(groups, key=lambda g: g.binding_id or 0)


class ResourceManager:
    """Owns every resource group of this process; ``bound_groups()`` are those holding resources."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._bound: list[ResourceGroup] = []  # in binding order
        self._live: weakref.WeakSet[ResourceGroup] = weakref.WeakSet()  # every group (for specifications)
        self._counters: dict[str | None, int] = {}  # scope key -> last binding id
        self._serial = 0
        self._release_callbacks: list[Callable[[], None]] = []
        self._runtime_users: dict[str, type[ResourceOwner]] = {}  # types bound since the last release
        self._failed_release: Scope | None = None  # where a failed runtime release is retried
        self._unreleased = ReleaseHooks(())  # the failed release's hooks that raised on this rank
        self.runtime_releases = 0

    # ----- membership -------------------------------------------------------------------
    def new_group(self, module_type: str, compatibility_key: Any, scope_key: Any,
                  shared: bool = False) -> ResourceGroup:
        group = ResourceGroup(module_type=module_type, compatibility_key=compatibility_key,
                              scope_key=scope_key, shared=shared)
        with self._lock:
            self._live.add(group)
        return group

    def new_token(self, module_type: str) -> MemberToken:
        with self._lock:
            self._serial += 1
            return MemberToken(module_type, self._serial)

    def retire(self, token: MemberToken) -> None:
        """Drop a member (module closed or collected). Never frees resources: a bound group left
        without members stays as an idle orphan for the next binding to recycle."""
        with self._lock:
            group = token.group
            if group is None:
                return
            group.members.pop(token, None)
            token.group = None
            if group.holds_resources and group.orphan:
                logger.debug("%s is now an orphan", group.describe())

    def bound_groups(self) -> list[ResourceGroup]:
        """Groups holding resources, in binding order."""
        with self._lock:
            return list(self._bound)

    def _active_specifications(self, group: ResourceGroup) -> tuple[Any, ...]:
        """Every live member's specification in the group's scope (same module type and scope
        key, bound or not), in creation order: enough to size one arena for the whole scope."""
        members = [(token.serial, spec) for g in list(self._live)
                   if not g.closed and g.module_type == group.module_type and g.scope_key == group.scope_key
                   for token, spec in g.members.items()]
        return tuple(spec for _, spec in sorted(members, key=lambda member: member[0]))

    # ----- binding ------------------------------------------------------------------------
    def bind(self, group: ResourceGroup | None, module: ResourceOwner, tensor: Any,
             refusal: Exception | None) -> Any:
        """First execution of an unbound group: recycle idle orphans, else create resources.

        Collective over the module's root group; ``refusal`` (a local mistake such as a
        non-tensor input) is agreed on first, so the peers raise with this rank.
        """
        scope = Scope(module._root_group())
        with self._lock:
            signature, specs = "", ()
            if refusal is None:
                assert group is not None  # a missing group always comes with a refusal
                try:
                    signature = repr((group.module_type, group.shared, module._resource_signature(tensor)))
                    specs = self._active_specifications(group)
                except Exception as exc:
                    refusal = exc
            candidates = [g for g in self._bound if g.scope is not None and g.scope.key == scope.key]
            manifest = [(g.binding_id, g.signature) for g in candidates]
            flags = [(g.orphan, _is_idle(g), self._compatible(g, group, signature, tensor))
                     if refusal is None else (False, False, False) for g in candidates]
            next_id = self._counters.get(scope.key, 0) + 1
            gathered = scope.gather("bind", (outcome_of(refusal), signature, manifest, flags, next_id))
            ranks = scope.ranks()
            raise_if_any_failed("bind", [item[0] for item in gathered], ranks, refusal)
            assert group is not None
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
                self._close_agreed(stale, "recycle")
            if reuse is not None:
                orphan = candidates[reuse]
                logger.info("recycle: reusing %s", orphan.describe())
                resources, creation = orphan.resources, orphan.creation_specifications
                self._bound.remove(orphan)
            else:
                resources = self._create(group, module, tensor, scope, specs)
                creation = tuple(repr(s) for s in specs)
            self._counters[scope.key] = next_id
            group.binding_id, group.scope, group.resources = next_id, scope, resources
            group.device, group.dtype, group.signature = tensor.device, tensor.dtype, signature
            group.creation_specifications = creation
            self._bound.append(group)
            self._runtime_users[group.module_type] = type(module)
        logger.debug("bound %s", group.describe())
        return resources

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

    def _create(self, group: ResourceGroup, module: ResourceOwner, tensor: torch.Tensor, scope: Scope,
                specs: tuple[Any, ...]) -> Any:
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

    # ----- collective close -----------------------------------------------------------------
    def _finish_close(self, group: ResourceGroup) -> None:
        group.closing, group.closed = False, True
        group.resources = group.scope = None  # nothing keeps the process group alive
        self._bound.remove(group)
        logger.debug("closed %s", group.describe())

    def _close_agreed(self, groups: Sequence[ResourceGroup], stage: str) -> None:
        """Close groups whose manifest and readiness were agreed, in binding-id order. A failure
        anywhere raises on every rank and leaves that group closing, with its resources, so that
        a retry calls close() again."""
        for group in _by_binding_id(groups):
            assert group.scope is not None
            group.closing = True
            group.scope.agree(f"{stage}: close binding id {group.binding_id}", group.resources.close)
            self._finish_close(group)

    def _gather_close(self, scope: Scope, groups: Sequence[ResourceGroup],
                      extra: Any) -> tuple[list[Any], list[int]]:
        """Exchange what each rank is about to close, which of it is busy, and ``extra``; raise on
        every rank when the ranks would close different groups."""
        manifest = [(g.binding_id, f"{g.signature} / {_lifecycle_text(g)}") for g in groups]
        busy = [g.binding_id for g in groups if not _is_idle(g)]
        gathered = scope.gather("close", (manifest, busy, extra))
        ranks = scope.ranks()
        detail = manifest_difference(CLOSE_MISMATCH, [item[0] for item in gathered], ranks)
        if detail:
            raise CollectiveError.create("close", {}, detail)
        return gathered, ranks

    @staticmethod
    def _raise_if_busy(gathered: list[Any], ranks: list[int]) -> None:
        busy = [f"rank {rank} (binding id(s) {item[1]})" for rank, item in zip(ranks, gathered, strict=True)
                if item[1]]
        if busy:
            raise CollectiveError.create("close", {}, f"not ready to close on {', '.join(busy)}: a call in "
                                                      "flight or a pending backward holds the resources")

    def close_groups(self, groups: Iterable[ResourceGroup] | None = None) -> None:
        """Collectively close bound groups (every one when ``groups`` is None): each root's groups
        over that root in binding-id order, the roots in the same order on every rank (this
        rank's own first, then by process-group name). Readiness is checked before anything is
        freed; a failure raises on every rank and leaves the group closing, for a retry."""
        with self._lock:
            chosen = list(self._bound) if groups is None else [g for g in groups if g.holds_resources]
            by_key: dict[str | None, list[ResourceGroup]] = {}
            for group in chosen:
                assert group.scope is not None
                by_key.setdefault(group.scope.key, []).append(group)
            for key in sorted(by_key, key=lambda k: (k is not None, k or "")):
                here = _by_binding_id(by_key[key])
                scope = here[0].scope
                assert scope is not None
                gathered, ranks = self._gather_close(scope, here, set(self._bound) <= set(here))
                self._raise_if_busy(gathered, ranks)
                self._close_agreed(here, "close")
                if all(item[2] for item in gathered):
                    self._release_fresh(scope)
            if not by_key:
                self.retry_failed_release()

    def close_member(self, token: MemberToken) -> None:
        """``module.close()``: the member retires; if it is the last member of its bound group on
        every rank, the group is closed collectively first (failures keep the member)."""
        with self._lock:
            group = token.group
            if group is None or not group.holds_resources:
                self.retire(token)
                self.retry_failed_release()
                return
            scope = group.scope
            assert scope is not None
            last = set(group.members) == {token}
            gathered, ranks = self._gather_close(scope, [group], (last, last and self._bound == [group]))
            if all(item[2][0] for item in gathered):
                self._raise_if_busy(gathered, ranks)
                self._close_agreed([group], "close")
                if all(item[2][1] for item in gathered):
                    self._release_fresh(scope)
            self.retire(token)

    # ----- process-wide runtime -----------------------------------------------------------
    def register_runtime_release(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the runtime is released (after the last group closes)."""
        with self._lock:
            if callback not in self._release_callbacks:
                self._release_callbacks.append(callback)

    def _release_hooks(self) -> ReleaseHooks:
        """This release's hooks: a failed release's leftovers, else every one (types first)."""
        if self._failed_release is not None:
            return self._unreleased
        hooks: list[Hook] = [(f"{name}._release_execution_runtime",
                              self._runtime_users[name]._release_execution_runtime)
                             for name in sorted(self._runtime_users)]
        hooks += [(getattr(cb, "__qualname__", repr(cb)), cb) for cb in self._release_callbacks]
        return ReleaseHooks(hooks)

    def _released(self) -> None:
        self._runtime_users.clear()
        self._failed_release = None
        self._unreleased = ReleaseHooks(())
        self.runtime_releases += 1

    def _release_runtime(self, scope: Scope, hooks: ReleaseHooks) -> None:
        """Run ``hooks`` as an agreed stage over ``scope``. A failure anywhere raises on every rank
        and keeps, on each rank, the hooks that raised there: the retry runs only those, while
        every rank of the scope still takes part in its agreement."""
        try:
            scope.agree(RUNTIME_RELEASE, hooks.run)
        except CollectiveError:
            self._failed_release, self._unreleased = scope, hooks
            raise
        self._released()

    def _release_fresh(self, scope: Scope) -> None:
        """The last close on every rank of ``scope`` left nothing bound: release the runtime."""
        self._failed_release = None  # a new release supersedes the old one's leftovers
        self._release_runtime(scope, self._release_hooks())

    def retry_failed_release(self) -> None:
        """Retry a runtime release that failed: on every rank that saw it fail, running only the
        hooks that raised there (the agreed error told every rank, so all of them take part)."""
        with self._lock:
            if self._failed_release is not None and not self._bound:
                self._release_runtime(self._failed_release, self._unreleased)

    # ----- local release (teardown) ---------------------------------------------------------
    def release_locally(self, groups: Iterable[ResourceGroup], reason: str,
                        even_if_busy: bool = False) -> None:
        """Close ``groups`` on this rank alone, never communicating: for teardown, when the
        peers may be gone or inside another collective. Each group is logged with ``reason``; one
        still in use (unless ``even_if_busy``) or whose close() fails keeps its resources. When
        nothing is left bound, the runtime is released here too."""
        with self._lock:
            for group in _by_binding_id(g for g in groups if g.holds_resources):
                logger.warning("%s: %s; resources %s %s", reason, group.describe(),
                               type(group.resources).__name__, _lifecycle_text(group))
                if not (even_if_busy or _is_idle(group)):
                    logger.warning("binding id %s is in use (a call in flight or a pending backward): "
                                   "left for a later close or the exit", group.binding_id)
                    continue
                try:
                    group.resources.close()
                except Exception:
                    logger.exception("closing %s on this rank failed", group.describe())
                    continue
                self._finish_close(group)
            if (self._runtime_users or self._failed_release is not None) and not self._bound:
                try:
                    self._release_hooks().run()
                except Exception:
                    logger.exception("the runtime release failed on this rank")
                else:
                    self._released()

    def release_member_locally(self, token: MemberToken, reason: str) -> None:
        """A member leaves without communicating; the last member of its group releases it here."""
        with self._lock:
            group = token.group
            if group is not None and set(group.members) == {token}:
                self.release_locally([group], reason)
            self.retire(token)

    def close_all_at_exit(self) -> None:
        """Interpreter exit: release locally whatever is left, and drop every process group.
        torch tells no one about ``destroy_process_group`` (and hyperpar does not patch it), so
        this is where groups left open past their process group's end are first seen: one
        warning names them all, then each is released here without communicating."""
        left = self.bound_groups()
        orphaned = [g for g in left if g.scope is not None and g.scope.root is not None and g.scope.local()]
        if orphaned:
            logger.warning("%s: %d resource group(s) still open after their process group was destroyed "
                           "(destroy_process_group releases nothing of hyperpar's; close() the modules or "
                           "call close_groups() before it): %s", OPEN_AFTER_DESTROY, len(orphaned),
                           "; ".join(f"process group {g.scope.key}: {g.describe()}" for g in orphaned
                                     if g.scope is not None))
        self.release_locally(left, NEVER_CLOSED, even_if_busy=True)
        self._failed_release = None


MANAGER = ResourceManager()


def close_groups(groups: Iterable[ResourceGroup] | None = None) -> None:
    """Close bound resource groups collectively (all of them by default), in binding-id order;
    the same call on every rank."""
    MANAGER.close_groups(groups)


def register_runtime_release(callback: Callable[[], None]) -> None:
    """Run ``callback`` once after the last resource group of the process closes."""
    MANAGER.register_runtime_release(callback)
