"""Checksums of storage bytes for ``OffloadConfig(verify=True)`` (a debug mode).

Two sums over the bytes, one of them position-weighted, so a changed, swapped or zeroed
range shows. Computed where the bytes are (on the device for device storages), in chunks so
the temporary stays small; the result is read back to the host, a sync that debug mode accepts.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 24
_MOD = 65521
_weights: dict[torch.device, torch.Tensor] = {}


def _weight(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        w = _weights[device] = (torch.arange(CHUNK_BYTES, device=device, dtype=torch.int32) % _MOD) + 1
    return w


def checksum(data: torch.Tensor) -> tuple[int, int]:
    """``data``: a flat uint8 tensor."""
    if data.numel() == 0:
        return (0, 0)
    w = _weight(data.device)
    plain = torch.zeros((), dtype=torch.int64, device=data.device)
    weighted = torch.zeros((), dtype=torch.int64, device=data.device)
    for index, start in enumerate(range(0, data.numel(), CHUNK_BYTES)):
        chunk = data[start: start + CHUNK_BYTES].to(torch.int32)
        plain += chunk.sum(dtype=torch.int64)
        weighted += (chunk * w[: chunk.numel()]).sum(dtype=torch.int64) * (index + 1)
    return int(plain), int(weighted)
