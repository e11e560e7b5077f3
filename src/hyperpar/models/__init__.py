"""Models built into hyperpar (no downloads) for the demo, benchmarks and tests."""

from hyperpar.models.gpt import GPT, GPTConfig, random_batch
from hyperpar.models.llama import Llama, LlamaConfig
from hyperpar.models.moe_ffn import MoeFeedForward, moe_ffn_factory

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MoeFeedForward", "moe_ffn_factory", "random_batch"]
