"""The orchestrator's trust domain: its travel machine, its CVM process, the GPU attester, the travel log, the baseline path."""
