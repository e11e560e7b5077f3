"""A fake resources class and modules that record every lifecycle call (importable by ranks)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist

from hyperpar.multicore import MulticoreModule


class FakeResources:
    """Counts close() calls; can refuse to close (busy) or fail a number of closes. ``owner`` is
    the specification of the module that created it (``size`` covers every active one)."""

    def __init__(self, size: int, shared: bool, specifications: tuple[Any, ...], close_failures: int = 0,
                 owner: Any = None) -> None:
        self.size = size
        self.owner = owner
        self.shared = shared
        self.specifications = specifications
        self.close_calls = 0
        self.closed = False
        self.busy = False
        self.close_failures = close_failures
        self.log: list[Any] | None = None  # appended with `owner` on every close() call

    def close(self) -> None:
        self.close_calls += 1
        if self.log is not None:
            self.log.append(self.owner)
        if self.close_failures > 0:
            self.close_failures -= 1
            raise OSError(f"fake close failure (size {self.size})")
        self.closed = True

    def can_close(self) -> bool:
        return not self.busy

    def lifecycle_signature(self) -> Any:
        return ("FakeResources", self.size, self.shared)


class NoCloseResources:
    def can_close(self) -> bool:
        return True

    def lifecycle_signature(self) -> Any:
        return "broken"


class FakeModule(MulticoreModule):
    """Its specification is an int (the workspace size); a shared group gets the largest."""

    def __init__(self, size: int = 4, key: Any = "fake", scope: Any = None, *, root: Any = None,
                 local: bool = False, close_failures: int = 0, create_error: Exception | None = None,
                 broken_resources: bool = False) -> None:
        super().__init__(resource_specification=size, resource_compatibility_key=key,
                         resource_scope_key=scope)
        self.weight = torch.nn.Parameter(torch.full((2,), float(size)))
        self.root = root
        self.local = local  # no root at all: never communicates
        self.close_failures = close_failures
        self.create_error = create_error
        self.broken_resources = broken_resources
        self.created: list[FakeResources] = []
        self.create_calls: list[dict[str, Any]] = []

    def _root_group(self) -> Any:
        if self.local:
            return None
        return self.root if self.root is not None else super()._root_group()

    def _create_execution_resources(self, tensor: torch.Tensor, *, shared: bool,
                                    active_specifications: tuple[Any, ...]) -> Any:
        self.create_calls.append({"shared": shared, "specs": active_specifications,
                                  "device": tensor.device, "dtype": tensor.dtype})
        if self.create_error is not None:
            raise self.create_error
        if self.broken_resources:
            return NoCloseResources()
        resources = FakeResources(max(active_specifications), shared, active_specifications,
                                  self.close_failures, owner=self.resource_specification)
        self.created.append(resources)
        return resources

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        resources = self._get_execution_resources(x)
        return x * self.weight.sum() + resources.size


class OtherFakeModule(FakeModule):
    """A different concrete type with the same keys."""


class ReleasingModule(FakeModule):
    """Its runtime hook counts calls and fails once on the ranks listed in ``fail_on``."""

    releases: ClassVar[int] = 0
    fail_on: ClassVar[set[int]] = set()

    @classmethod
    def _release_execution_runtime(cls) -> None:
        cls.releases += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank in cls.fail_on:
            cls.fail_on.discard(rank)
            raise OSError("native runtime teardown failed")
