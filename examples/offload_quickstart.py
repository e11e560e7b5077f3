"""The README's offload quick start: a GPT step keeps at most 16 MiB of activations on the device.

    python examples/offload_quickstart.py
"""

import torch

from hyperpar.models import GPT, GPTConfig, random_batch
from hyperpar.offload import OffloadConfig, OffloadSession

model = GPT(GPTConfig.small())  # about 39 MiB of activations per step at batch 8
optimizer = torch.optim.AdamW(model.parameters())
session = OffloadSession(OffloadConfig(max_resident_activation_mb=16))
for _ in range(3):
    x, y = random_batch(model.cfg, batch_size=8)
    with session:  # step 0 traces and plans, later steps replay the plan
        loss = model.loss(x, y)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(session.last_report)
