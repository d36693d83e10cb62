"""examples/tabular_train.py ported to GPU Travelling: the loop is unchanged, the data loader is
one gputravel call. It runs as the orchestrator's job, on records that travel from each holder:

    gputravel demo --script examples/tabular_train_gputravel.py --workload tabular
"""

import torch
from torch import nn

from gputravel.workloads.script import batches, keep, log

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for epoch in range(3):
    for batch in batches():
        x, y = batch["features"], batch["label"]
        loss = nn.functional.cross_entropy(model(torch.sign(x) * torch.log1p(x.abs())), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"epoch {epoch} loss {loss.item():.4f}")
        log(loss=loss.item())

keep(model)  # the model a job manifest seals, and releases to its recipients
