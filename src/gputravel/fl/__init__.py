"""The federated-learning baseline: FedAvg on a real Flower deployment (docs/fl.md).

The paper's other alternative to GPU Travelling (its section 2.1): the data stays at the
holders, the model travels over the network every round, and every holder trains on its own
compute. Here it runs on Flower's deployment engine, each piece in its own process: the
SuperLink (with the ServerApp) in the orchestrator's network namespace, one SuperNode (with
its ClientApps) in each holder's, all over the same tc-capped links the travels and the TLS
baseline use (net/shaped.py), their bytes counted on those links (net/counters.py).

- :mod:`.config`: FedAvg's knobs and the plan they make for a job, checked before anything starts;
- :mod:`.local`: what a holder computes (local steps) and the held-out evaluation;
- :mod:`.server_app`, :mod:`.client_app`: the Flower apps;
- :mod:`.bundle`: the Flower App directory, the Flower CLI's configuration, TLS material;
- :mod:`.deploy`: the supervisor that owns every Flower process and the links;
- :mod:`.run`: one FedAvg job, start to report.
"""
