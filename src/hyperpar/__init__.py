"""hyperpar: train PyTorch models that do not fit.

- :mod:`hyperpar.offload`: planned activation offload to host memory.
- :mod:`hyperpar.multicore`: collectively owned execution resources and ``MoeExperts``.
"""

__version__ = "0.1.0"
