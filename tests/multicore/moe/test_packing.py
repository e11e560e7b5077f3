"""Values packed after each peer's rows come back bit for bit, and the rows skip them."""

from __future__ import annotations

import pytest
import torch

from hyperpar.multicore.moe.packing import Blocks

CASES = [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize(("wire", "values_dtype"), CASES)
def test_values_round_trip_and_rows_skip_them(wire: torch.dtype, values_dtype: torch.dtype) -> None:
    width = 6  # 12 or 24 bytes a row: a float32 value per 3 or 6 rows' worth of bytes
    rows, values = [5, 0, 7], [5, 0, 7]
    blocks = Blocks.of(rows, values, width * wire.itemsize, values_dtype.itemsize)
    row_bytes = width * wire.itemsize
    assert blocks.value_rows == tuple(-(-n * values_dtype.itemsize // row_bytes) for n in values)
    assert blocks.splits == [r + v for r, v in zip(rows, blocks.value_rows, strict=True)]
    buffer = torch.full((blocks.total, width), -1.0).to(wire)
    data = torch.randn(sum(rows), width).to(wire)
    positions = blocks.row_positions(buffer.device)
    buffer[positions] = data
    vals = torch.randn(sum(values)).to(values_dtype)
    blocks.write_values(buffer, vals)
    assert torch.equal(blocks.read_values(buffer, values_dtype), vals)
    assert torch.equal(buffer.index_select(0, positions), data)  # the values overwrote no row
    for begin, first, count in blocks.spans():
        assert torch.equal(buffer[begin:begin + count], data[first:first + count])


def test_without_values_the_rows_are_contiguous() -> None:
    blocks = Blocks.of([3, 4], [0, 0], 32, 4)
    assert not blocks.packed and blocks.total == 7 and blocks.splits == [3, 4]
    assert torch.equal(blocks.row_positions(torch.device("cpu")), torch.arange(7))
    assert blocks.read_values(torch.zeros(7, 8), torch.float32).numel() == 0
