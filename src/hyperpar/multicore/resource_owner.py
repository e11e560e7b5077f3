"""What the resource manager asks of a module it binds: four hooks and nothing else.

``MulticoreModule`` implements them (its subclasses override them, see docs/multicore.md);
the manager sees a module only through this protocol, so ``manager`` never imports
``module`` while ``module`` imports the manager, and the surface between them is written
down in one place.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ResourceOwner(Protocol):
    """A module as the manager sees it when binding its group and releasing its runtime."""

    def _root_group(self) -> Any:
        """The process group binding and closing are collective over (None: never communicates)."""

    def _resource_signature(self, tensor: torch.Tensor) -> Any:
        """What the resources depend on, identical on every rank."""

    def _create_execution_resources(self, tensor: torch.Tensor, *, shared: bool,
                                    active_specifications: tuple[Any, ...]) -> Any:
        """Allocate the group's resources for the first input ``tensor``."""

    @classmethod
    def _release_execution_runtime(cls) -> None:
        """Release the type's process-wide native runtime after the last group closes."""
