"""A few SGD steps of a small DDP model on each rank's own random batches: the training the
DDP tests compare, bit for bit, between ways of reducing the gradients."""

from __future__ import annotations

import torch
from torch import nn


def sgd_steps(ddp: nn.Module, model: nn.Module, rank: int, steps: int) -> torch.Tensor:
    """`steps` steps of `ddp` (wrapping `model`, 16 inputs, 4 outputs); `model`'s parameters after."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
