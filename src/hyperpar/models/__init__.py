"""Models built into hyperpar (no downloads) for the demo, benchmarks and tests."""

from hyperpar.models.gpt import GPT, GPTConfig, random_batch

__all__ = ["GPT", "GPTConfig", "random_batch"]
