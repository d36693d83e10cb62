"""A gputravel workload: a small CNN that classifies 8x8 handwritten digits (plain PyTorch;
nothing to subclass). A workload file names its SCHEMA, builds its model and turns a batch of
records into (inputs, targets); loss, optimizer and metrics have defaults."""

import torch
from torch import nn

SCHEMA = "image: uint8[1,8,8]; label: int64[]"


def model(schema):
    classes = len(schema.field("label").names) or 10
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes),
    )


def inputs(records):
    return records["image"].to(torch.float32) / 255.0, records["label"]
