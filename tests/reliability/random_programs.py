"""Random small models built from a list of instructions, for offload equality fuzzing.

A program is a list of ``Instr`` drawn by hypothesis; ``RandomProgram`` interprets it on a
pool of ``[B, D]`` tensors that starts with the step's input. Each instruction reads pool
entries (indices taken modulo the pool size) and appends its results, so any instruction
sequence is a valid model. The kinds cover what capture has to get right: elementwise ops,
reductions broadcast back, matmuls with parameters and between activations, views that share
storage, tuple outputs, tensor lists in and out, in-place writes (on fresh tensors, on
no-grad tensors, and anywhere, which autograd may reject in both runs alike), dropout (the
RNG stream must match) and opaque ``skip_offload`` regions.

``DATA_KINDS`` (issue 11) are what op names and shapes do not show: an in-place write (or a
read) whose target depends on the step's data, sparse COO matrices built from activations
(``torch.sparse.mm``), and reads behind the dispatcher (``.numpy()``, ``.tolist()``, ``repr``)
whose values the model records in ``seen`` for comparison with the plain run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from hyperpar.offload import skip_offload

B, D = 4, 8
KINDS = (
    "unary", "binary", "linear", "pair_matmul", "reduce", "max_tuple", "var_mean", "view_t",
    "view_expand", "split_cat", "stack", "foreach", "inplace_fresh", "inplace_nograd", "inplace_any",
    "dropout", "opaque", "opaque_nograd", "checkpoint", "norm_softmax", "index", "unbind", "inplace_view",
    "embedding", "conv", "where", "dtype",
)
UNARY = (torch.sin, torch.tanh, torch.relu, torch.sigmoid, torch.neg, lambda t: t * 0.5)


@dataclass(frozen=True)
class Instr:
    kind: str
    a: int
    b: int
    c: int
    variant: int

    def __repr__(self) -> str:  # short, so that a falsifying example is easy to paste as a test
        return f"Instr({self.kind!r}, {self.a}, {self.b}, {self.c}, {self.variant})"


DATA_KINDS = ("alias_choice", "sparse_mm", "detach_read")
VARYING_KINDS = ("alias_choice", "sparse_mm")  # may touch other storages or shapes from step to step


def _instructions(kinds: st.SearchStrategy[str]) -> st.SearchStrategy[Instr]:
    return st.builds(Instr, kinds, st.integers(0, 63), st.integers(0, 63), st.integers(0, 63),
                     st.integers(0, 5))


instructions = _instructions(st.sampled_from(KINDS))
programs = st.lists(instructions, min_size=1, max_size=14)
# half of the instructions from DATA_KINDS, the rest mixed in from every other kind
data_programs = st.lists(_instructions(st.one_of(st.sampled_from(DATA_KINDS), st.sampled_from(KINDS))),
                         min_size=1, max_size=12)


def _region(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs untraced inside a session: several ops, two outputs (one a view)."""
    h = torch.tanh(u * 1.5 + v)
    return h * v.sigmoid(), h.t().t()


opaque_region = skip_offload(_region)


class RandomProgram(nn.Module):
    def __init__(self, program: list[Instr]) -> None:
        super().__init__()
        self.program = list(program)
        self.weights = nn.Parameter(torch.randn(3, D, D) / math.sqrt(D))
        self.bias = nn.Parameter(torch.randn(D) * 0.1)
        self.seen: list[object] = []  # what detach_read read, in order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool: list[torch.Tensor] = [x, x * self.bias]
        for ins in self.program:
            pool.extend(self._run(ins, pool))
        loss = pool[0].new_zeros(())
        for i, t in enumerate(pool):
            loss = loss + t.sum() / (i + 1)
        return loss

    def _run(self, ins: Instr, pool: list[torch.Tensor]) -> list[torch.Tensor]:
        n = len(pool)
        a, b, c, v = pool[ins.a % n], pool[ins.b % n], pool[ins.c % n], ins.variant
        kind = ins.kind
        if kind == "unary":
            return [UNARY[v % len(UNARY)](a)]
        if kind == "binary":
            ops = (torch.add, torch.mul, torch.sub, torch.maximum)
            return [ops[v % len(ops)](a, b)]
        if kind == "linear":
            w = self.weights[v % 3]
            return [F.linear(a, w, self.bias) if v % 2 else torch.tanh(a @ w)]
        if kind == "pair_matmul":
            return [(a @ b.t()) @ c / (B * D)]
        if kind == "reduce":
            r = a.sum(dim=1, keepdim=True) if v % 2 else a.mean(dim=0, keepdim=True)
            return [b + 0.1 * r]
        if kind == "max_tuple":
            values, indices = torch.max(a, dim=1, keepdim=True)
            return [b + values, b.gather(1, indices.expand(B, D))]
        if kind == "var_mean":
            var, mean = torch.var_mean(a, dim=0, keepdim=True)
            return [(b - mean) * torch.rsqrt(var + 1.0)]
        rows = a.shape[0]
        if kind == "view_t":
            return [a.reshape(D, rows).t()]  # non-contiguous view of a's storage
        if kind == "view_expand":
            return [a[v % rows:v % rows + 1].expand(rows, D)]
        if kind == "split_cat":
            left, right = torch.split(a, D // 2, dim=1)
            return [torch.cat([right, left * 2.0], dim=1), left.repeat(1, 2)]
        if kind == "stack":
            return [torch.stack([a, b, c]).sum(0)]
        if kind == "foreach":
            return list(torch._foreach_mul([a, b], 0.5))
        if kind == "inplace_fresh":
            y = a * 1.0
            if v % 3 == 0:
                y.add_(b)
            elif v % 3 == 1:
                y.mul_(0.5).relu_()
            else:
                y[:, : D // 2].copy_(c[:, : D // 2])
            return [y]
        if kind == "inplace_nograd":
            with torch.no_grad():
                y = a * 2.0
            y.add_(1.0)  # later read again: a stale host copy would show here
            return [y, y * b]
        if kind == "inplace_any":
            # May be rejected by autograd (a saved tensor modified): the same in both runs.
            if v % 2:
                a.mul_(0.75)
            else:
                a.add_(b)
            return [a]
        if kind == "dropout":
            return [F.dropout(a, p=0.3, training=True)]
        if kind == "opaque":
            # Inputs private to the region: see test_opaque_input_shared_outside_the_region.
            return list(opaque_region(a * 1.0, b * 1.0))
        if kind == "opaque_shared":  # not in KINDS: a known gradient-order difference
            return list(opaque_region(a, b))
        if kind == "opaque_nograd":
            with torch.no_grad():
                u, w = opaque_region(a * 1.0, b * 1.0)
            return [u + b, w]
        if kind == "checkpoint":  # recomputed in backward, dropout included
            return [checkpoint(_checkpointed, a, b, self.weights[v % 3], use_reentrant=False)]
        if kind == "norm_softmax":
            h = F.layer_norm(a, (D,))
            return [h.softmax(-1) + F.log_softmax(b, dim=-1)]
        if kind == "index":
            idx = torch.arange(rows - 1, -1, -1, device=a.device)
            out = a.index_select(0, idx).scatter_add(1, (idx % D).unsqueeze(1).expand(rows, 2), b[:, :2])
            return [out.index_put((idx[:1],), c[:1] * 2.0)]
        if kind == "unbind":
            scaled = torch.stack([r * (i + 1) for i, r in enumerate(a.unbind(0))])
            return [scaled, b.chunk(2, dim=1)[v % 2].repeat(1, 2)]
        if kind == "inplace_view":
            y = a * 1.0
            y[:, v % D].mul_(2.0)  # through a view: CopySlices
            y.diagonal().add_(b.diagonal())
            return [y]
        if kind == "embedding":
            ids = a.argmax(dim=1)  # integer activations, no grad
            return [F.embedding(ids, self.weights[v % 3]) + b, ids.float().unsqueeze(1).expand(rows, D)]
        if kind == "conv":
            w = self.weights[v % 3][:, : 3].unsqueeze(1)  # [D, 1, 3]: depthwise over the D channels
            return [F.conv1d(a.t().unsqueeze(0), w, padding=1, groups=D).squeeze(0).t()]
        if kind == "where":
            return [torch.where(a > b, a, c * 0.5).masked_fill(b < -1.0, 0.25)]
        if kind == "dtype":
            wide = a.double() * b.double()
            half = (a * 0.1).to(torch.bfloat16) + c.to(torch.bfloat16)
            return [wide.float(), half.float()]
        if kind == "alias_choice":
            # The input changes every step, so which buffer is written (or read) does too.
            y, z = a * 1.0, b * 1.0
            first = bool(pool[0][0, v % D] > 0) if v % 2 == 0 else bool(a[0, 0] > b[0, 0])
            chosen = y if first else z
            if v < 4:
                chosen.add_(c[:1] * 0.5)  # same op and shapes either way
                return [y, z]
            return [torch.tanh(chosen @ self.weights[v % 3]), y + z]
        if kind == "sparse_mm":
            if v % 2 == 0:  # fixed number of entries: the k largest of each row
                k = 1 + v % 3
                vals, cols = a.topk(k, dim=1)
                idx = torch.stack([torch.arange(rows, device=a.device).repeat_interleave(k), cols.flatten()])
                coo = torch.sparse_coo_tensor(idx, vals.flatten(), (rows, D), check_invariants=True)
            else:  # data-dependent number of entries
                mask = a > 0
                coo = torch.sparse_coo_tensor(mask.nonzero().t(), a[mask], (rows, D), check_invariants=True)
            return [torch.sparse.mm(coo, self.weights[v % 3]) + b]
        if kind == "detach_read":
            h = a if v % 2 == 0 else b
            how = v % 3
            if how == 0:
                self.seen.append(h.detach().numpy().copy())
            elif how == 1:
                self.seen.append(h.tolist())
            else:
                self.seen.append(repr(h))
            return []
        raise AssertionError(kind)


def _checkpointed(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.dropout(torch.tanh(a @ w) * b, p=0.2, training=True)
