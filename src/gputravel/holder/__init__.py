"""The data holder's trust domain: its travel machine and its CVM process."""
