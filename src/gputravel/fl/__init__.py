"""The federated-learning baseline (paper 2.1): FedAvg on a real Flower deployment, each holder
training on its own compute over the same capped links the travels use (docs/fl.md).
"""
