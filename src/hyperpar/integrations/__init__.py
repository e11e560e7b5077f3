"""Integrations with training frameworks; each needs its framework installed (an extra).

``hyperpar.integrations.hf``: the Hugging Face ``Trainer`` (``pip install 'hyperpar[hf]'``).
"""

__all__: list[str] = []
