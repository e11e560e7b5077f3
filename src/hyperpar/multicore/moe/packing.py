"""One all-to-all that carries rows and one value per row (a route weight, or its gradient).

Each peer's block of the exchanged buffer holds its rows, then their values packed as raw
bytes into whole rows of the same width (``ceil(n * value_bytes / row_bytes)`` rows: a few
per thousand). A separate exchange of the values would cost about what the rows' does on
gloo (measured 0.2-0.3 ms of CPU time per call for a few KiB, at the bench shapes), twice
per backward. Every rank derives a block's layout from counts it already has, so sender
and receiver agree without telling each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Blocks:
    """The layout of one piece's side of an exchange: per peer, ``rows`` rows then ``values``
    values packed into ``value_rows`` rows, the blocks one after another in peer order."""

    rows: tuple[int, ...]
    values: tuple[int, ...]
    value_rows: tuple[int, ...]
    value_bytes: int

    @staticmethod
    def of(rows: list[int], values: list[int], row_bytes: int, value_bytes: int) -> Blocks:
        value_rows = tuple(-(-n * value_bytes // row_bytes) for n in values)
        return Blocks(tuple(rows), tuple(values), value_rows, value_bytes)

    @property
    def splits(self) -> list[int]:
        return [r + v for r, v in zip(self.rows, self.value_rows, strict=True)]

    @property
    def total(self) -> int:
        return sum(self.rows) + sum(self.value_rows)

    @property
    def packed(self) -> bool:
        """Whether any value rows interleave with the rows (if not, the rows are contiguous)."""
        return any(self.value_rows)

    def spans(self) -> list[tuple[int, int, int]]:
        """Per peer: (first row of its block, first of its rows among all blocks' rows, count)."""
        out, begin, first = [], 0, 0
        for rows, extra in zip(self.rows, self.value_rows, strict=True):
            out.append((begin, first, rows))
            begin += rows + extra
            first += rows
        return out

    def row_positions(self, device: torch.device) -> Tensor:
        """The buffer row of every row, in block order (the rows skip the value rows)."""
        parts = [torch.arange(begin, begin + n, device=device) for begin, _, n in self.spans()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    def _value_bytes(self, buffer: Tensor) -> list[Tensor]:
        regions, begin = [], 0
        for rows, extra, count in zip(self.rows, self.value_rows, self.values, strict=True):
            region = buffer[begin + rows:begin + rows + extra].reshape(-1).view(torch.uint8)
            regions.append(region[:count * self.value_bytes])
            begin += rows + extra
        return regions

    def write_values(self, buffer: Tensor, values: Tensor) -> None:
        """Put ``values`` (every peer's, in block order) into the value rows of ``buffer``."""
        raw = values.contiguous().view(torch.uint8)
        start = 0
        for region in self._value_bytes(buffer):
            region.copy_(raw[start:start + region.numel()])
            start += region.numel()

    def read_values(self, buffer: Tensor, dtype: torch.dtype) -> Tensor:
        """Every peer's values from the value rows of ``buffer``, in block order (a new tensor)."""
        regions = self._value_bytes(buffer)
        raw = torch.cat(regions) if regions else buffer.new_empty(0, dtype=torch.uint8)
        return raw.view(dtype)
