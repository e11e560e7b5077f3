"""Train with a Hugging Face ``Trainer`` inside an ``OffloadSession``.

The Trainer runs forward and backward of one micro-batch in ``Trainer.training_step``, and
the optimizer step outside it, so the session wraps exactly ``training_step``: one session
step per micro-batch. The Trainer's callbacks cannot do this: they are called around a
micro-batch (``on_step_begin``, ``on_substep_end``) but cannot wrap it, and a session
entered in one callback and left in another would stay active when the step raises.

With gradient accumulation the micro-batches of one optimizer step differ (the first
creates ``.grad``, the next ones add into it); the session keeps a plan for each and
learns their order, so after the first cycle every micro-batch replays.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from hyperpar.offload import OffloadConfig, OffloadSession

__all__ = ["OffloadTrainer", "OffloadTrainerMixin"]


class OffloadTrainerMixin:
    """Put before a ``Trainer`` class (``class T(OffloadTrainerMixin, SFTTrainer)``): its
    ``training_step`` runs in ``self.offload_session``.

    ``offload`` is the session to use or an ``OffloadConfig`` to build one from (default:
    ``OffloadConfig()``, a 1 GiB budget on the current accelerator).
    """

    def __init__(self, *args: Any, offload: OffloadSession | OffloadConfig | None = None,
                 **kwargs: Any) -> None:
        if offload is None:
            offload = OffloadConfig()
        if isinstance(offload, OffloadConfig):
            offload = OffloadSession(offload)
        if not isinstance(offload, OffloadSession):
            raise TypeError(f"offload= needs an OffloadSession or an OffloadConfig, got {offload!r}")
        self.offload_session = offload
        super().__init__(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.offload_session:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]


class OffloadTrainer(OffloadTrainerMixin, Trainer):
    """``transformers.Trainer`` whose every micro-batch runs in an ``OffloadSession``."""
