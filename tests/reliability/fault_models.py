"""A chain model that can be told to fail at one place: a forward hook, or a custom autograd
Function raising in forward or in backward, or inside a ``skip_offload`` region."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar.offload import skip_offload

WHERE = ("hook", "function_forward", "function_backward", "opaque")


class Trigger:
    """Raises ``exc`` at its site when armed; shared by the model and its deep copy's twin."""

    def __init__(self) -> None:
        self.exc: BaseException | None = None
        self.where = ""
        self.layer = -1

    def fire(self, where: str, layer: int) -> None:
        if self.exc is not None and self.where == where and self.layer == layer:
            raise self.exc


class _MaybeRaise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, trigger: Trigger, layer: int) -> torch.Tensor:
        ctx.trigger, ctx.layer = trigger, layer
        trigger.fire("function_forward", layer)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.trigger.fire("function_backward", ctx.layer)
        return grad, None, None


class FaultyChain(nn.Module):
    def __init__(self, layers: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.trigger = Trigger()
        for i, block in enumerate(self.blocks):
            block.register_forward_hook(self._hook(i))
        self.trigger_opaque = skip_offload(self._opaque)

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            self.trigger.fire("hook", layer)
        return hook

    def _opaque(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        h = torch.tanh(h) * 1.1
        self.trigger.fire("opaque", layer)
        return h + 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, block in enumerate(self.blocks):
            h = _MaybeRaise.apply(torch.relu(block(h)), self.trigger, i)
            h = self.trigger_opaque(h, i)
        return h.square().mean()

    def __deepcopy__(self, memo: dict[int, Any]) -> FaultyChain:
        twin = FaultyChain(len(self.blocks), self.blocks[0].in_features)
        twin.load_state_dict(self.state_dict())
        return twin
