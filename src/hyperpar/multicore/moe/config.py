"""MoeExperts configuration, validated in full before anything is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

# Measured with `hyperpar bench moe` on 2 gloo ranks (docs/moe.md): chunking did not pay
# for its extra collectives on CPU, so the default is one chunk.
DEFAULT_OVERLAP_CHUNKS = 1
GEMM_DTYPES = (torch.bfloat16, torch.float16)  # what gemm_dtype may name (None: the input's dtype)
# compared across EP ranks, in this order (MoeExpertsConfig.signature)
SIGNATURE_FIELDS = ("local_num_tokens", "hidden_size", "intermediate_size", "num_experts", "top_k",
                    "expert_capacity_factor", "swiglu_limit", "ep_size", "create_parameters",
                    "overlap_chunks", "gemm_dtype")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _optional_real(name: str, value: object, minimum: float, strict: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be None or a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    below = number <= minimum if strict else number < minimum
    if not math.isfinite(number) or below:
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"{name} must be None or a finite number {bound}, got {value!r}")
    return number


@dataclass(frozen=True)
class MoeExpertsConfig:
    local_num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    expert_capacity_factor: float | None = None
    swiglu_limit: float | None = None
    ep_size: int = 1
    create_parameters: bool = True
    overlap_chunks: int = DEFAULT_OVERLAP_CHUNKS
    gemm_dtype: torch.dtype | None = None  # opt-in: the expert GEMMs' operand dtype

    def __post_init__(self) -> None:
        for name in ("local_num_tokens", "hidden_size", "intermediate_size", "num_experts", "top_k",
                     "ep_size", "overlap_chunks"):
            _positive_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must not exceed num_experts={self.num_experts}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by ep_size={self.ep_size}")
        object.__setattr__(self, "expert_capacity_factor", _optional_real(
            "expert_capacity_factor", self.expert_capacity_factor, 1.0, strict=False))
        object.__setattr__(self, "swiglu_limit", _optional_real(
            "swiglu_limit", self.swiglu_limit, 0.0, strict=True))
        if not isinstance(self.create_parameters, bool):
            raise TypeError(f"create_parameters must be a bool, got {type(self.create_parameters).__name__} "
                            f"{self.create_parameters!r}")
        if self.gemm_dtype is not None and self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError("gemm_dtype must be None, torch.bfloat16 or torch.float16, "
                             f"got {self.gemm_dtype!r}")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def send_rows(self) -> int:
        return self.local_num_tokens * self.top_k

    @property
    def capacity_rows(self) -> int:
        """Rows one rank may receive: every row of every rank (lossless) unless a factor bounds it."""
        lossless = self.ep_size * self.send_rows
        if self.expert_capacity_factor is None:
            return lossless
        return min(lossless, math.ceil(self.send_rows * self.expert_capacity_factor))

    def capacity_description(self) -> str:
        if self.expert_capacity_factor is None:
            return (f"lossless: ep_size={self.ep_size} x local_num_tokens={self.local_num_tokens} "
                    f"x top_k={self.top_k}")
        return (f"expert_capacity_factor={self.expert_capacity_factor:g} x local_num_tokens="
                f"{self.local_num_tokens} x top_k={self.top_k}")

    def signature_fields(self) -> dict[str, object]:
        """Every configuration value by name, rank-independent and picklable."""
        return {name: getattr(self, name) for name in SIGNATURE_FIELDS} | {"gemm_dtype": str(self.gemm_dtype)}

    def signature(self) -> tuple[object, ...]:
        """Every configuration value, rank-independent: compared across ranks at first binding."""
        return ("MoeExperts", *self.signature_fields().values())


def describe_differences(fields_by_rank: dict[int, dict[str, object]]) -> str:
    """Which configuration fields differ, and each rank's value of them: what a user needs to
    find the rank that was built differently."""
    first = next(iter(fields_by_rank.values()))
    differing = [name for name in first if any(f.get(name) != first[name] for f in fields_by_rank.values())]
    per_rank = "; ".join(f"EP rank {rank}: " + ", ".join(f"{name}={fields.get(name)!r}" for name in differing)
                         for rank, fields in fields_by_rank.items())
    return f"fields {', '.join(differing)} differ: {per_rank}"
