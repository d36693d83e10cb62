"""A gputravel workload: an MLP that tells malignant from benign tumours from 30 measurements
(the Wisconsin breast-cancer table). log1p tames the features' scales (areas in the thousands,
smoothness near 0.1) without statistics from any holder's data."""

import torch
from torch import nn

SCHEMA = "features: float32[30]; label: int64[]"


def model(schema):
    classes = len(schema.field("label").names) or 2
    width = schema.field("features").shape[0]
    return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, classes))


def inputs(records):
    x = records["features"]
    return torch.sign(x) * torch.log1p(x.abs()), records["label"]
