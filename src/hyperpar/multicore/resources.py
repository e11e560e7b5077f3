"""What a resource group holds, and the contract its execution resources object must meet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from hyperpar.multicore.collective import Scope


@runtime_checkable
class ExecutionResources(Protocol):
    """Long-lived native resources (workspaces, communication buffers) owned by a group."""

    def close(self) -> None:
        """Free the resources. Must be idempotent: a retry after a partial failure calls it again."""

    def can_close(self) -> bool:
        """False while a call is in flight or a backward graph still needs the resources."""

    def lifecycle_signature(self) -> Any:
        """A rank-independent description, compared across ranks before a close."""


class MemberToken:
    """Stands for one module inside a group; a token, not the module, so that the group never
    keeps a module alive (membership is retired by ``weakref.finalize``)."""

    __slots__ = ("__weakref__", "group", "module_type", "serial")

    def __init__(self, module_type: str, serial: int) -> None:
        self.module_type = module_type
        self.serial = serial
        self.group: ResourceGroup | None = None

    def __repr__(self) -> str:
        return f"MemberToken({self.module_type}#{self.serial})"


@dataclass(eq=False)
class ResourceGroup:
    """Modules that execute serially and share one set of execution resources.

    ``members`` maps each member's token to its resource specification. A group whose
    members are all gone but that still holds resources is an *orphan*: its
    native memory stays allocated until the next binding recycles it or a cleanup closes it.
    """

    module_type: str
    compatibility_key: Any
    scope_key: Any
    members: dict[MemberToken, Any] = field(default_factory=dict)
    shared: bool = False
    resources: Any = None
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    binding_id: int | None = None
    scope: Scope | None = None  # where its lifecycle collectives run; dropped when it closes
    signature: str = ""
    creation_specifications: tuple[str, ...] = ()
    closing: bool = False
    closed: bool = False

    @property
    def bound(self) -> bool:
        return self.binding_id is not None

    @property
    def orphan(self) -> bool:
        return not self.members

    @property
    def holds_resources(self) -> bool:
        return self.bound and not self.closed

    def describe(self) -> str:
        """What the group is, for logs and errors."""
        state = "closed" if self.closed else "closing" if self.closing else "open"
        members = "orphan" if self.orphan else f"{len(self.members)} member(s)"
        return (f"binding id {self.binding_id} ({self.module_type}, {members}, {state}, "
                f"device={self.device}, dtype={self.dtype}, signature={self.signature})")
