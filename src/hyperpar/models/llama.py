"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).

Plain torch ops only, so that every op is visible to the offload tracer and the model runs
unchanged on CPU and on accelerators. Used by the GPU benchmark, where its activation
profile (many medium tensors per block, attention through ``scaled_dot_product_attention``)
is the one real training jobs have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_INT_FIELDS = ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 64  # longest sequence; sizes the rotary table
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 64
    ffn_hidden: int = 176  # SwiGLU intermediate size
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig.d_model / n_head (head_dim {self.head_dim}) must be even for rotary embeddings"
            )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"LlamaConfig.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be finite and > 0, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def num_parameters(self) -> int:
        """Exact parameter count (untied embedding and head), for sizing by arithmetic."""
        d, f = self.d_model, self.ffn_hidden
        attn = d * d + 2 * d * self.kv_dim + d * d
        block = attn + 3 * d * f + 2 * d
        return self.n_layer * block + 2 * self.vocab_size * d + d

    @classmethod
    def tiny(cls) -> LlamaConfig:
        return cls(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64)

    @classmethod
    def small(cls) -> LlamaConfig:
        return cls(vocab_size=512, seq_len=128, n_layer=4, n_head=8, n_kv_head=2, d_model=128,
                   ffn_hidden=352)

    @classmethod
    def medium(cls) -> LlamaConfig:
        return cls(vocab_size=4096, seq_len=512, n_layer=8, n_head=16, n_kv_head=4, d_model=1024,
                   ffn_hidden=2816)

    @classmethod
    def llama3_8b_shape(cls, n_layer: int = 32, seq_len: int = 4096, vocab_size: int = 32000) -> LlamaConfig:
        """The Llama-3-8B block shape (d 4096, 32 heads, 8 KV heads, SwiGLU 14336)."""
        return cls(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=32, n_kv_head=8,
                   d_model=4096, ffn_hidden=14336, rope_theta=500000.0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # statistics in fp32 whatever the activation dtype
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [seq_len, head_dim], in the half-split (rotate_half) layout."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_head != self.n_head:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def embed(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token embeddings and the rotary tables cut to the sequence, in the activation dtype."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, seq], got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds LlamaConfig.seq_len={self.cfg.seq_len}")
        x = self.tok(idx)
        return x, self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, cos, sin = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
