"""Tiny models whose storage accesses depend on the data while their ops and shapes do not:
``x[0, 0] > 0`` picks which of two activations an op writes (or reads). A replay that only
checks op names and shapes cannot see the difference."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar.offload import skip_offload

ROWS, D = 64, 8  # activations of 2 KiB: they dominate the peak, so every budget evicts them


def choice_input(step: int, gen: torch.Generator, rows: int = ROWS) -> torch.Tensor:
    """Even steps take the first branch (x[0, 0] > 0), odd steps the other."""
    x = torch.randn(rows, D, generator=gen)
    x[0, 0] = 1.0 if step % 2 == 0 else -1.0
    return x


class _Tail(nn.Module):
    """Two activations in, a scalar loss out; ``a`` and ``b`` are saved for backward and
    enough activations follow that budgets up to 75 % of the peak evict them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(D, D) / 3) for _ in range(4))

    def tail(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(a @ self.w[2]) * torch.sigmoid(b @ self.w[3])
        for _ in range(4):
            h = torch.tanh(h * 1.5)
        return h.sum()


class WriteChoice(_Tail):
    """``(b if x[0, 0] > 0 else a).add_(1)``: warmup writes one buffer, the next step the other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x @ self.w[0], x @ self.w[1]
        (b if x[0, 0] > 0 else a).add_(1.0)
        return self.tail(a, b)


class ReadChoice(_Tail):
    """The choice decides which buffer a later matmul reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.tanh(x @ self.w[0]), x @ self.w[1]
        chosen = b if x[0, 0] > 0 else a
        return self.tail(chosen @ self.w[1], a * b)


@skip_offload
def _write_in_region(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # a and b are leaves inside the region
        (b if x[0, 0] > 0 else a).add_(1.0)
    return a * b


class RegionWriteChoice(_Tail):
    """The data-dependent write happens inside a ``skip_offload`` region, to one of its inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x @ self.w[0], x @ self.w[1]
        both = _write_in_region(x, a, b)
        return self.tail(a, b) + both.sum()


class ListOrderChoice(_Tail):
    """``torch.cat`` takes its tensors in a list (the general input check): the data picks
    their order, so the op and its shapes stay the same while the storages swap places."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x @ self.w[0], x @ self.w[1]
        both = torch.cat([a, b] if x[0, 0] > 0 else [b, a], dim=1)
        return self.tail(both[:, :D], both[:, D:])


class ParameterOrActivation(_Tail):
    """The same matmul reads a parameter on one step and an activation of the same shape on
    the next, the other ops unchanged (the one-pass check of positional inputs: "not an
    activation" must hold)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x @ self.w[0], torch.tanh(x @ self.w[1])
        made = torch.tanh(self.w[2] * 1.5)
        right = self.w[2] if x[0, 0] > 0 else made
        return self.tail(a @ right, b * made.sum())


class OptionalInput(_Tail):
    """An optional tensor argument present on one step and absent on the next
    (``native_layer_norm``'s bias): the op and its output shapes are the same, its number of
    tensor inputs is not."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(D) + 0.5)
        self.bias = nn.Parameter(torch.randn(D) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x @ self.w[0], x @ self.w[1]
        h = torch.nn.functional.layer_norm(a, (D,), self.gain, self.bias if x[0, 0] > 0 else None)
        return self.tail(h, b)


class OutputDtypeChoice(_Tail):
    """The same copy makes a float64 activation on one step and a bfloat16 one on the next
    (``_to_copy``'s dtype argument): the ops and their inputs are the plan's, only an
    output's dtype tells the steps apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x @ self.w[0], torch.tanh(x @ self.w[1])
        c = torch.tanh(a * 1.5).to(torch.float64 if x[0, 0] > 0 else torch.bfloat16, copy=True)
        return self.tail(c.to(torch.float32, copy=True), b)


class OutputRankChoice(_Tail):
    """The same ``view`` gives a flat or a 2-d alias and the copy after it keeps that rank:
    only the outputs' ranks differ between the steps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x @ self.w[0], torch.tanh(x @ self.w[1])
        shape = (ROWS * D,) if x[0, 0] > 0 else (ROWS, D)
        c = torch.tanh(a * 1.5).view(shape).clone()
        return self.tail(c.view(ROWS, D), b)
