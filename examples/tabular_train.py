"""A stock PyTorch training script: an MLP on the breast-cancer table, read from local CSVs.
examples/tabular_train_gputravel.py is the same script ported to GPU Travelling (docs/workloads.md).

    python examples/tabular_train.py DIR [DIR ...]   # record datasets written by `gputravel data pack table`
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gputravel.data.records import load_records

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
arrays = [load_records(path).array for path in sys.argv[1:]]
features = torch.cat([torch.from_numpy(a["features"].copy()) for a in arrays])
labels = torch.cat([torch.from_numpy(a["label"].copy()) for a in arrays])
loader = DataLoader(TensorDataset(features, labels), batch_size=8, shuffle=True)

for epoch in range(3):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(torch.sign(x) * torch.log1p(x.abs())), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"epoch {epoch} loss {loss.item():.4f}")
