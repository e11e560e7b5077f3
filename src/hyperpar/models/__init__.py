"""Models built into hyperpar (no downloads) for the demo, benchmarks and tests."""

from hyperpar.models.gpt import GPT, GPTConfig, random_batch
from hyperpar.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "random_batch"]
